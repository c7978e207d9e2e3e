"""K3ReplayWorker: the `BaseSpecWorker` SGLang builds for K3_REPLAY / K3_REPLAY_TREE.

SGLang constructs it as `Cls(server_args=, gpu_id=, nccl_port=, target_worker=)` (spec_info.create_worker).
Drafts come from each request's own history (`k3.rollout.spec.ngram.NgramDrafter`: prompt lookup, chains or
token trees; no draft model, so `draft_worker` is None and no weights are the draft's); verify is the target's
TARGET_VERIFY forward with an `EagleVerifyInput` (SGLang's tree metadata: retrieve_next_token / _sibling); the
acceptance walks the tree greedily (`k3.rollout.spec.accept.accept_at_node`), and the commit is SGLang's
`commit_mamba_states_after_verify`, whose hybrid hook runs the ReplaySSM fold (`k3_sglang.spec`).

The pieces are methods (`draft_trees`, `verify_layout`, `accept`) so that they are tested through SGLang's classes
on CPU; `forward_batch_generation` strings them together with SGLang's scheduler-side helpers (KV slot assignment
and the accepted-token KV move), which need the CUDA model runner and were not run here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from k3.rollout.spec.accept import accept_at_node
from k3.rollout.spec.ngram import NgramDrafter
from k3.rollout.spec.tree import DraftTree
from k3.rollout.types import SamplingParams
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

_GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class VerifyLayout:
    """Per request, D verify positions: 0 = the pending token, i + 1 = draft node i, then padding leaves."""

    tokens: torch.Tensor                 # [B, D] int64
    parents: torch.Tensor                # [B, D] int64 (-1 for position 0)
    retrieve_next_token: torch.Tensor    # [B, D] int64, first child (-1: none)
    retrieve_next_sibling: torch.Tensor  # [B, D] int64, next sibling (-1: none)
    real: torch.Tensor                   # [B, D] bool: position carries a drafted token (or the pending one)


@dataclass(frozen=True)
class Accepted:
    accept_lens: torch.Tensor   # [B] int32, accepted positions incl. the pending token
    accept_index: torch.Tensor  # [B, D] int64 flat positions (b * D + i) of the accepted path, -1 padded
    emitted: list[list[int]]    # per request: the tokens this verify emits (accepted drafts + correction/bonus)


class K3ReplayWorker(BaseSpecWorker):
    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker) -> None:
        super().__init__()
        from sglang.srt.runtime_context import get_spec

        self.server_args = server_args
        self.gpu_id, self.nccl_port = gpu_id, nccl_port
        self._target_worker = target_worker
        self._draft_worker = None
        cfg = get_spec()
        self.draft_token_num = int(cfg.speculative_num_draft_tokens)
        self.speculative_num_draft_tokens = self.draft_token_num
        self.branching = max(1, int(cfg.speculative_eagle_topk or 1))
        self.drafter = NgramDrafter()

    @property
    def draft_worker(self):
        return None  # no draft model: drafts come from the requests' own tokens

    def clear_cache_pool(self) -> None:
        pass

    # ------------------------------------------------------------------ drafting
    def draft_trees(self, contexts: list[list[int]]) -> list[DraftTree]:
        """One tree of at most D - 1 nodes per request (its tokens so far, the pending one last); a tree of
        branching b is at most (D - 1) // b deep, so that each of its first b continuations fits whole."""
        n = self.draft_token_num - 1
        depth = max(1, n // self.branching)
        return [self.drafter.propose_tree(ctx, self.branching, depth, n) for ctx in contexts]

    def verify_layout(self, pending: list[int], trees: list[DraftTree]) -> VerifyLayout:
        D, B = self.draft_token_num, len(trees)
        tokens = torch.zeros(B, D, dtype=torch.int64)
        parents = torch.zeros(B, D, dtype=torch.int64)
        real = torch.zeros(B, D, dtype=torch.bool)
        for b, (tok, tree) in enumerate(zip(pending, trees)):
            if len(tree) > D - 1:
                raise ValueError(f"trees[{b}]: {len(tree)} nodes exceed speculative_num_draft_tokens - 1 = {D - 1}")
            par = tree.verify_parents()
            tokens[b, 0], real[b, : len(par)] = tok, True
            tokens[b, 1: len(par)] = torch.tensor(tree.tokens, dtype=torch.int64)
            parents[b, : len(par)] = torch.tensor(par, dtype=torch.int64)
            parents[b, len(par):] = 0  # padding leaves under the pending token: verified, never accepted
            tokens[b, len(par):] = tok
        nxt = torch.full((B, D), -1, dtype=torch.int64)
        sib = torch.full((B, D), -1, dtype=torch.int64)
        for b in range(B):
            last_child: dict[int, int] = {}
            for i in range(1, D):
                p = int(parents[b, i])
                if p in last_child:
                    sib[b, last_child[p]] = i
                else:
                    nxt[b, p] = i
                last_child[p] = i
        return VerifyLayout(tokens, parents, nxt, sib, real)

    # ------------------------------------------------------------------ acceptance
    def accept(self, layout: VerifyLayout, logits: torch.Tensor) -> Accepted:
        """Greedy walk over each request's tree: logits [B * D, vocab] of the verify positions."""
        B, D = layout.tokens.shape
        logits = logits.view(B, D, -1)
        lens = torch.zeros(B, dtype=torch.int32)
        index = torch.full((B, D), -1, dtype=torch.int64)
        emitted: list[list[int]] = []
        for b in range(B):
            node, path, out = 0, [0], []
            while True:
                children = [i for i in range(1, D) if layout.real[b, i] and int(layout.parents[b, i]) == node]
                e, pick = accept_at_node(logits[b, node], [int(layout.tokens[b, c]) for c in children], _GREEDY,
                                         None, match=False)
                out.append(e.token)
                if pick is None:
                    break
                node = children[pick]
                path.append(node)
            lens[b] = len(path)
            index[b, : len(path)] = torch.tensor(path) + b * D
            emitted.append(out)
        return Accepted(lens, index, emitted)

    # ------------------------------------------------------------------ one scheduler step
    def forward_batch_generation(self, batch, on_publish=None, pp_proxy_tensors=None):
        from sglang.srt.managers.scheduler import GenerationBatchResult
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.speculative.eagle_info import EagleVerifyInput
        from sglang.srt.speculative.spec_utils import (commit_mamba_states_after_verify,
                                                       move_accept_tokens_to_target_kvcache)

        if not batch.forward_mode.is_decode():
            return self.target_worker.forward_batch_generation(batch, pp_proxy_tensors=pp_proxy_tensors)
        D, device = self.draft_token_num, batch.seq_lens.device
        contexts = [list(r.origin_input_ids) + list(r.output_ids) for r in batch.reqs]
        layout = self.verify_layout([c[-1] for c in contexts], self.draft_trees(contexts))
        B = len(contexts)
        depth = torch.zeros(B, D, dtype=torch.int64)
        for i in range(1, D):
            depth[:, i] = depth.gather(1, layout.parents[:, i: i + 1]).squeeze(1) + 1
        positions = (batch.seq_lens.view(B, 1).to(torch.int64).cpu() + depth).flatten()
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        batch.input_ids = layout.tokens.flatten().to(device)
        batch.spec_info = EagleVerifyInput(
            draft_token=batch.input_ids, custom_mask=self._tree_mask(layout, batch).to(device),
            positions=positions.to(device), retrieve_index=torch.arange(B * D, device=device).view(B, D),
            retrieve_next_token=layout.retrieve_next_token.to(device),
            retrieve_next_sibling=layout.retrieve_next_sibling.to(device),
            retrieve_cum_len=torch.arange(B + 1, dtype=torch.int32, device=device) * D, spec_steps=D - 1,
            topk=self.branching, draft_token_num=D, capture_hidden_mode=None, seq_lens_sum=batch.seq_lens_sum,
            seq_lens_cpu=batch.seq_lens_cpu)
        result = self.target_worker.forward_batch_generation(batch, pp_proxy_tensors=pp_proxy_tensors,
                                                             is_verify=True)
        acc = self.accept(layout, result.logits_output.next_token_logits.float().cpu())
        accept_lens, accept_index = acc.accept_lens.to(device), acc.accept_index.to(device)
        commit_mamba_states_after_verify(self.target_worker, batch, accept_lens, accept_index, D)
        move_accept_tokens_to_target_kvcache(batch, accept_index, accept_lens - 1,
                                             self.target_worker.get_memory_pool()[1])
        new_seq_lens = batch.seq_lens + accept_lens
        if on_publish is not None:
            on_publish(new_seq_lens)
        batch.forward_mode = ForwardMode.DECODE
        next_ids = torch.tensor([t for e in acc.emitted for t in e], dtype=torch.int64, device=device)
        return GenerationBatchResult(logits_output=result.logits_output, next_token_ids=next_ids,
                                     can_run_cuda_graph=False, accept_lens=accept_lens, new_seq_lens=new_seq_lens,
                                     speculative_num_draft_tokens=D)

    @staticmethod
    def _tree_mask(layout: VerifyLayout, batch) -> torch.Tensor:
        """SGLang's flat custom mask: per request, [D, prefix + D] (the prefix, then ancestors and self)."""
        B, D = layout.tokens.shape
        parts = []
        for b in range(B):
            anc = torch.zeros(D, D, dtype=torch.bool)
            for i in range(D):
                j = i
                while j >= 0:
                    anc[i, j] = True
                    j = int(layout.parents[b, j]) if j > 0 else -1
            prefix = int(batch.seq_lens_cpu[b])
            parts.append(torch.cat([torch.ones(D, prefix, dtype=torch.bool), anc], dim=1).flatten())
        return torch.cat(parts)
