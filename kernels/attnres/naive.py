"""Block Attention Residuals references.

K3 convention (HF modeling_kimi_linear `_apply_attn_res`): candidates are the stored block rows (embedding first)
plus the running partial sum of the current block; keys are the RMS-normed candidates, scored against a learned
pseudo-query (`proj.weight * norm.weight`); softmax over depth; the mixture of the RAW candidates is rounded to the
candidates' dtype.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def naive_block_attnres(rows: Sequence[torch.Tensor], partial: torch.Tensor, query: torch.Tensor,
                        norm_weight: torch.Tensor, eps: float = 1e-6,
                        output_norm_weight: torch.Tensor | None = None) -> torch.Tensor:
    """rows: stored block rows, each [..., D]; partial: [..., D]; query, norm_weight: [D].

    Returns the mixture [..., D] (in partial.dtype); with `output_norm_weight` the following RMSNorm is applied
    to the rounded mixture (K3 rounds before the prenorm). Math in fp32, or fp64 for fp64 inputs (a float64
    evaluation is the tests' ground truth).
    """
    ct = torch.promote_types(partial.dtype, torch.float32)
    v = torch.stack([*rows, partial], dim=-2).to(ct)                        # [..., L, D]
    keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    scores = (keys * (norm_weight.to(ct) * query.to(ct))).sum(-1)           # [..., L]
    mix = (torch.softmax(scores, dim=-1).unsqueeze(-2) @ v).squeeze(-2).to(partial.dtype)
    if output_norm_weight is None:
        return mix
    m = mix.to(ct)
    return (m * torch.rsqrt(m.pow(2).mean(-1, keepdim=True) + eps) * output_norm_weight.to(ct)).to(partial.dtype)
