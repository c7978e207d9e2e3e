"""ReplaySSM speculative decoding for SGLang: `--speculative-algorithm K3_REPLAY` (chain) / `K3_REPLAY_TREE`.

SGLang's default verify of a KDA layer stores every draft token's full recurrent state ([HV, V, K] fp32 per token,
`MambaPool.SpeculativeState.intermediate_ssm`) and its commit (`commit_mamba_states_after_verify` ->
`HybridLinearAttnBackend.update_mamba_state_after_mtp_verify`) copies the accepted token's state. ReplaySSM keeps
only each draft token's step inputs (l2-normed k, v, log-decay g, beta: H K + HV (V + K + 1) values instead of
HV V K) and, at commit, folds the accepted path's inputs into the committed state (`k3_kernels.replay_ssm`), the
same arithmetic as decoding those tokens one by one. SGLang's own ReplaySSM (`--enable-linear-replayssm-spec`) is
chain-only and skips K3's lower-bound gate; this one verifies token trees (each node from its parent's state,
inputs only: `k3_kernels.replay_ssm.tree_verify`) and takes K3's gate.

Wiring, all through SGLang's extension points:
- `SpeculativeAlgorithm.register("K3_REPLAY" / "K3_REPLAY_TREE", validate_server_args=...)`: the factory returns
  `K3ReplayWorker` (a `BaseSpecWorker`, built by SGLang as `Cls(server_args=, gpu_id=, nccl_port=,
  target_worker=)`: n-gram drafts from the request's own history, `k3.rollout.spec.ngram.NgramDrafter`).
- verify: the KDA layers run `--linear-attn-backend k3` (required by the validator); its `target_verify` calls
  `replay_verify` below when a K3_REPLAY algorithm is active, which records the step inputs per layer.
- commit: an AROUND hook on `update_mamba_state_after_mtp_verify` runs SGLang's commit (conv-window rollback)
  and then replaces each KDA layer's committed state with the ReplaySSM fold of the accepted path.

Not done (said in the README): SGLang still allocates `intermediate_ssm` for the pool (its size is fixed by
`MambaPool.SpeculativeState`, which no plugin point reaches), so the memory is saved only in what verify writes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from k3_kernels.kda.naive import l2norm, naive_kda_gate, naive_kda_lowerbound_gate
from k3_kernels.replay_ssm import path_inputs, replay_commit, tree_verify

CHAIN = "K3_REPLAY"
TREE = "K3_REPLAY_TREE"
MAX_DRAFT_TOKENS = 16
COMMIT_TARGET = ("sglang.srt.layers.attention.hybrid_linear_attn_backend.HybridLinearAttnBackend"
                 ".update_mamba_state_after_mtp_verify")


@dataclass(frozen=True)
class VerifyInputs:
    """One KDA layer's verify, kept until its commit: node-major [D, B, ...] step inputs and the tree."""

    k: torch.Tensor        # [D, B, H, K] l2-normed
    v: torch.Tensor        # [D, B, HV, V]
    g: torch.Tensor        # [D, B, HV, K] log-decay, fp32
    beta: torch.Tensor     # [D, B, HV] fp32
    parents: torch.Tensor  # [B, D] int64, -1: the committed state

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.g, self.beta))


# keyed by the layer's intermediate-state buffer (SGLang hands target_verify that view, one per layer)
_pending: dict[int, VerifyInputs] = {}


def replay_active() -> bool:
    from sglang.srt.runtime_context import get_spec

    name = get_spec().speculative_algorithm
    return isinstance(name, str) and name.upper() in (CHAIN, TREE)


def pending_layers() -> dict[int, VerifyInputs]:
    return dict(_pending)


def replay_verify(*, A_log, dt_bias, q, k, v, a, b, ssm_states, cache_indices, layer_key: int, cache_steps: int,
                  retrieve_parent_token, lower_bound) -> torch.Tensor:
    """ReplaySSM verify of one KDA layer: outputs from inputs only; records the step inputs for the commit."""
    _, tokens, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    D = int(cache_steps)
    B = tokens // D
    node_major = lambda x, *shape: x.reshape(B, D, *shape).transpose(0, 1).contiguous()  # noqa: E731
    qn = node_major(l2norm(q.float()), H, K)
    kn = node_major(l2norm(k.float()), H, K)
    vn = node_major(v.float(), HV, V)
    raw = a.reshape(B, D, HV, K)
    g = (naive_kda_gate(raw, A_log, dt_bias) if lower_bound is None
         else naive_kda_lowerbound_gate(raw, A_log, dt_bias, lower_bound))
    g = g.transpose(0, 1).contiguous()
    beta = torch.sigmoid(b.reshape(B, D, HV).float()).transpose(0, 1).contiguous()
    if retrieve_parent_token is None:
        parents = torch.arange(-1, D - 1, device=q.device).expand(B, D).clone()
    else:  # SGLang's parent of draft token 0 is unset (the committed state)
        parents = retrieve_parent_token.reshape(B, D).to(torch.int64).clone()
        parents[:, 0] = -1
    root = ssm_states.index_select(0, cache_indices[:B].to(torch.int64)).transpose(-1, -2)  # [B, HV, K, V]
    o, _ = tree_verify(root.contiguous(), qn, kn, vn, g, beta, parents)
    _pending[layer_key] = VerifyInputs(kn, vn, g, beta, parents)
    return o.transpose(0, 1).reshape(1, tokens, HV, V).to(v.dtype)


def commit_layer(temporal: torch.Tensor, committed: torch.Tensor, state_indices: torch.Tensor,
                 accepted_node: torch.Tensor, inputs: VerifyInputs) -> None:
    """Fold each row's accepted path into its committed state (`committed` [B, HV, V, K], read before SGLang's
    commit ran) and write it to `temporal[state_indices]` ([P, HV, V, K] fp32)."""
    B = inputs.parents.shape[0]
    rows = state_indices[:B].to(torch.int64)
    node = accepted_node[:B].to(torch.int64)
    k, n = path_inputs(inputs.k, inputs.parents, node)
    v, _ = path_inputs(inputs.v, inputs.parents, node)
    g, _ = path_inputs(inputs.g, inputs.parents, node)
    beta, _ = path_inputs(inputs.beta, inputs.parents, node)
    new = replay_commit(committed.transpose(-1, -2).contiguous().float(), k, v, g, beta, n)
    temporal.index_copy_(0, rows, new.transpose(-1, -2).to(temporal.dtype))


def _commit_hook(original, self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track, model,
                 req_pool_indices=None):
    """SGLang's commit (conv-window rollback; its SSM scatter is replaced below), then the ReplaySSM fold."""
    if not _pending:
        return original(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track, model,
                        req_pool_indices)
    try:
        if mamba_track_indices is not None:
            raise RuntimeError("K3_REPLAY commit with mamba track slots: use --mamba-radix-cache-strategy no_buffer")
        linear = self.linear_attn_backend
        n = last_correct_step_indices.shape[0]
        state_indices = linear.forward_metadata.mamba_cache_indices[:n]
        caches = linear.req_to_token_pool.get_speculative_mamba2_params_all_layers()
        rows = state_indices.to(torch.int64)
        keys = [caches.intermediate_ssm[layer].data_ptr() for layer in range(caches.temporal.shape[0])]
        layers = [(layer, _pending[key], caches.temporal[layer].index_select(0, rows))
                  for layer, key in enumerate(keys) if key in _pending]
        result = original(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track, model,
                          req_pool_indices)
        for layer, inputs, committed in layers:
            commit_layer(caches.temporal[layer], committed, state_indices, last_correct_step_indices, inputs)
    finally:
        _pending.clear()
    return result


def validate_server_args(server_args, *, tree: bool) -> None:
    """Refuses, naming the flag, what K3_REPLAY cannot serve (before any request runs)."""
    from sglang.srt.arg_groups.overrides import resolving_view

    cfg = resolving_view(server_args)
    name = TREE if tree else CHAIN
    backend = cfg.linear_attn_verify_backend or cfg.linear_attn_decode_backend or cfg.linear_attn_backend
    if backend != "k3":
        raise ValueError(f"--speculative-algorithm {name} verifies KDA layers with k3_kernels: add "
                         f"--linear-attn-backend k3 (verify backend resolves to {backend!r})")
    topk = cfg.speculative_eagle_topk or 1
    if tree and topk < 2:
        raise ValueError(f"--speculative-algorithm {TREE} needs --speculative-eagle-topk >= 2 (branching), got {topk}")
    if not tree and topk != 1:
        raise ValueError(f"--speculative-algorithm {CHAIN} is a chain: --speculative-eagle-topk 1, got {topk} "
                         f"(use {TREE} for trees)")
    tokens = cfg.speculative_num_draft_tokens
    if tokens is None or not 2 <= tokens <= MAX_DRAFT_TOKENS:
        raise ValueError(f"--speculative-num-draft-tokens must be in [2, {MAX_DRAFT_TOKENS}], got {tokens}")
    strategy = getattr(cfg, "mamba_radix_cache_strategy", None)
    if strategy not in (None, "auto", "no_buffer"):
        raise ValueError(f"--mamba-radix-cache-strategy {strategy}: K3_REPLAY commits exact states at accepted "
                         "tokens only; use no_buffer")


_done = False


def register() -> None:
    global _done
    if _done:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from .spec_worker import K3ReplayWorker

    for name, tree in ((CHAIN, False), (TREE, True)):
        SpeculativeAlgorithm.register(
            name, supports_overlap=False,
            validate_server_args=lambda args, tree=tree: validate_server_args(args, tree=tree),
        )(lambda server_args: K3ReplayWorker)
    HookRegistry.register(COMMIT_TARGET, _commit_hook, HookType.AROUND)
    _done = True
