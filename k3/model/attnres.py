"""Block Attention Residuals, K3 convention (block size counts decoder layers; the embedding is the first stored
row; only the attention side is a block boundary). A sub-layer's input is a softmax-over-depth mixture of the
stored block rows and the current block's running partial sum, scored by a learned pseudo-query (`*_res_proj`,
zero-initialised: uniform mixing at init) against the RMS-normed candidates (`*_res_norm`)."""
from __future__ import annotations

import torch
from torch import nn

from k3.model import ops
from k3.model.norm import RMSNorm


def attn_res(rows: list[torch.Tensor], partial: torch.Tensor, proj: nn.Linear, norm: RMSNorm,
             prenorm: RMSNorm | None = None) -> torch.Tensor:
    """The mixture; with `prenorm`, that RMSNorm applied to the (rounded) mixture, fused into the same op."""
    if prenorm is not None and prenorm.eps != norm.eps:
        raise ValueError(f"prenorm.eps {prenorm.eps} must equal the AttnRes norm's eps {norm.eps} to fuse them")
    return ops.block_attnres(rows, partial, proj.weight.view(-1), norm.weight, norm.eps,
                             None if prenorm is None else prenorm.weight)


def pseudo_query(d: int) -> nn.Linear:
    p = ops.Linear(d, 1, bias=False)
    nn.init.zeros_(p.weight)
    return p
