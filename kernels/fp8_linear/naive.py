"""Spec of the weight-only FP8 linear: y = (x @ q.T) * scale, q = w * (448 / amax) rounded to e4m3 (scale = the
row's amax / 448; moe.naive._scales), accumulated in fp32, rounded once to x's dtype."""
from __future__ import annotations

import torch

from k3_kernels.moe.naive import naive_quant_rows

MAX_ROWS = 64   # rows the Triton kernel takes in one call (the head drafts for at most a decode batch of rows)


def quantize_weight_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q float8_e4m3fn [N, K], scale fp32 [N]): one scale per output row (MoE's row quantiser with
    the whole row as its block)."""
    if w.dim() != 2 or w.shape[1] == 0:
        raise ValueError(f"w: expected a non-empty [N, K] matrix, got {tuple(w.shape)}")
    q, scale = naive_quant_rows(w, block=w.shape[1])
    return q, scale[:, 0].contiguous()


def check_fp8_linear_args(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """Shapes and dtypes, named, before any work."""
    if q.dim() != 2 or q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"q: expected a float8_e4m3fn [N, K] matrix, got {q.dtype} {tuple(q.shape)}")
    if x.shape[-1] != q.shape[1]:
        raise ValueError(f"x: last dim {x.shape[-1]} does not match the weight's K = {q.shape[1]}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"x: expected bfloat16 or float32, got {x.dtype}")
    if scale.shape != (q.shape[0],) or scale.dtype != torch.float32:
        raise ValueError(f"scale: expected fp32 [{q.shape[0]}], got {scale.dtype} {tuple(scale.shape)}")


def naive_fp8_weight_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] (bf16 or fp32), q [N, K] e4m3, scale [N] fp32 -> [..., N] in x's dtype."""
    check_fp8_linear_args(x, q, scale)
    rows = x.reshape(-1, x.shape[-1]).float()
    out = (rows @ q.float().t()) * scale
    return out.to(x.dtype).reshape(*x.shape[:-1], q.shape[0])
