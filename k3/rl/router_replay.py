"""Router Replay (R3, Ma et al., arXiv 2510.11370): the learner routes every token through the experts the rollout
engine chose, and recomputes the gate weights from its own router over that set (so the router still learns).

The model does the replay (`K3ForCausalLM.forward(..., routed_experts=...)`, see `k3.model.moe.Router`); this module
checks recorded routings as they arrive from an engine (int16 in verl, int32 in SGLang, int64 here) and measures how
far two routings differ (how many experts a perturbed or updated trainer would flip without replay).
"""
from __future__ import annotations

import torch

from k3.config import K3Config


def check_routed_experts(routed: object, batch: int, length: int, config: K3Config | None = None,
                         name: str = "routed_experts") -> torch.Tensor:
    """Validate recorded expert ids [B, T', n_moe, k] for a batch of `batch` sequences of `length` tokens.

    T' may be T or T - 1 (engines record the tokens they forwarded: the last sampled token never is). A (token,
    layer) whose k ids are all -1 was not recorded (e.g. a prompt served from a prefix cache): the model routes it
    freely. With a config, n_moe, k and the id range are checked too. Returns int64 ids; raises ValueError naming
    `name`."""
    if not isinstance(routed, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(routed).__name__}")
    if routed.is_floating_point() or routed.is_complex() or routed.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer expert ids, got dtype {routed.dtype}")
    if routed.dim() != 4:
        raise ValueError(f"{name} must be [B, T, n_moe_layers, top_k], got shape {tuple(routed.shape)}")
    if routed.shape[0] != batch or routed.shape[1] not in (length, length - 1):
        raise ValueError(f"{name} shape {tuple(routed.shape)} does not match tokens [B={batch}, T={length}] "
                         f"(needs [B, T or T-1, ...])")
    if config is not None:
        want = (len(config.moe_layer_ids), config.num_experts_per_token)
        if tuple(routed.shape[2:]) != want:
            raise ValueError(f"{name} has {tuple(routed.shape[2:])} (n_moe_layers, top_k) but the model has {want}")
        if routed.numel() and (int(routed.min()) < -1 or int(routed.max()) >= config.num_experts):
            raise ValueError(f"{name}: expert ids must be in [0, {config.num_experts}) or -1 (not recorded), got "
                             f"range [{int(routed.min())}, {int(routed.max())}]")
    free = routed < 0
    if bool((free.any(-1) != free.all(-1)).any()):
        raise ValueError(f"{name}: a token's ids in a layer must be all valid or all -1 (not recorded)")
    return routed.long()


def routing_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, float]:
    """How routing `a` differs from recorded routing `b` ([B, T, n_moe, k], order within the top-k ignored), over
    the tokens of `mask` [B, T] and the (token, layer) pairs recorded in `b` (ids -1 are skipped).

    flip_frac: fraction of (token, MoE layer) pairs whose expert sets differ; token_flip_frac: fraction of tokens
    with a different set in at least one layer; expert_flip_frac: fraction of the k slots replaced."""
    if a.shape != b.shape or a.dim() != 4:
        raise ValueError(f"routings must be equal-shaped [B, T, n_moe, k], got {tuple(a.shape)} and {tuple(b.shape)}")
    m = torch.ones(a.shape[:2], dtype=torch.bool, device=a.device) if mask is None else mask.bool()
    if m.shape != a.shape[:2]:
        raise ValueError(f"mask shape {tuple(m.shape)} does not match routings {tuple(a.shape[:2])}")
    pairs = m[..., None] & (b >= 0).all(-1)                              # [B, T, n_moe] compared pairs
    missing = ~(a[..., :, None] == b[..., None, :]).any(-1) & pairs[..., None]  # experts of a not in b's set
    layer_diff = missing.any(-1)
    tokens = pairs.any(-1)
    n_pairs = max(int(pairs.sum()), 1)
    return {
        "flip_frac": float(layer_diff.sum()) / n_pairs,
        "token_flip_frac": float(layer_diff.any(-1).sum()) / max(int(tokens.sum()), 1),
        "expert_flip_frac": float(missing.sum()) / (n_pairs * a.shape[3]),
    }
