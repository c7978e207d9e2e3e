"""Weight-only FP8 linear (spec: naive.py) for a few rows, two layouts of one memory-bound loop (each reads every
weight byte once, half of a bf16 weight's bytes, upcasts the e4m3 tile to the activations' dtype -- exact: e4m3
values are bf16 values -- and accumulates in fp32 in a fixed order):

* `rows_major`: each program owns BLOCK_N output columns for every row (rows padded to one 16-row tile), the
  activations as the dot's left operand;
* `swapped` (default): y^T = W x^T, the weight tile the dot's left operand (on sm_90 it can stay in registers after
  the upcast; the activations, the small operand, go through shared memory), with an optional split of K into
  `split_k` ranges whose fp32 partial sums a second launch adds in order (no atomics: the same bits on every call,
  and a row's output never depends on the rows beside it).

The row scales multiply the sums at the end."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from k3_kernels.fp8_linear.naive import MAX_ROWS, check_fp8_linear_args
from k3_kernels.launch import cdiv, next_pow2


@dataclass(frozen=True)
class Fp8LinearTile:
    """Launch settings of `fp8_weight_linear`: the layout (`swapped` or `rows_major`), output columns per program,
    K per loop step, warps, pipeline stages, and (swapped only) the ranges K is split into."""
    layout: str = "swapped"
    block_n: int = 64
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1

    def __post_init__(self):
        if self.layout not in ("swapped", "rows_major"):
            raise ValueError(f"layout: expected 'swapped' or 'rows_major', got {self.layout!r}")
        if self.split_k < 1 or (self.split_k > 1 and self.layout != "swapped"):
            raise ValueError(f"split_k: {self.split_k} (>= 1; above 1 with the swapped layout only)")


DEFAULT_TILE = Fp8LinearTile()


@triton.jit
def _rows_major_kernel(x_ptr, q_ptr, s_ptr, y_ptr, M, N, K, x_stride, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    rows = tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < K
        x = tl.load(x_ptr + rows[:, None] * x_stride + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(q_ptr + cols[None, :].to(tl.int64) * K + kk[:, None], mask=cmask[None, :] & kmask[:, None],
                    other=0.0)
        acc += tl.dot(x, w.to(x.dtype), input_precision="ieee")
    scale = tl.load(s_ptr + cols, mask=cmask, other=0.0)
    out = acc * scale[None, :]
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], out.to(y_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _swapped_kernel(x_ptr, q_ptr, s_ptr, y_ptr, part_ptr, M, N, K, x_stride, k_per_split, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    k_lo = split * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < k_hi
        w = tl.load(q_ptr + cols[:, None].to(tl.int64) * K + kk[None, :], mask=cmask[:, None] & kmask[None, :],
                    other=0.0)
        xt = tl.load(x_ptr + rows[None, :] * x_stride + kk[:, None], mask=rmask[None, :] & kmask[:, None], other=0.0)
        acc += tl.dot(w.to(xt.dtype), xt, input_precision="ieee")
    mask = cmask[:, None] & rmask[None, :]
    if SPLIT == 1:
        scale = tl.load(s_ptr + cols, mask=cmask, other=0.0)
        out = acc * scale[:, None]
        tl.store(y_ptr + rows[None, :] * N + cols[:, None], out.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + split * M * N + rows[None, :] * N + cols[:, None], acc, mask=mask)


@triton.jit
def _sum_splits_kernel(part_ptr, s_ptr, y_ptr, M, N, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):   # split 0, 1, ... in order
        acc += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0)
    scale = tl.load(s_ptr + offs % N, mask=mask, other=0.0)
    tl.store(y_ptr + offs, (acc * scale).to(y_ptr.dtype.element_ty), mask=mask)


def fp8_weight_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                      tile: Fp8LinearTile = DEFAULT_TILE) -> torch.Tensor:
    """x [..., K] (bf16 or fp32, at most MAX_ROWS rows), q [N, K] e4m3, scale [N] fp32 -> [..., N] in x's dtype."""
    check_fp8_linear_args(x, q, scale)
    rows = x.reshape(-1, x.shape[-1])
    M, K = rows.shape
    if M > MAX_ROWS:
        raise ValueError(f"x: {M} rows, the FP8 weight-only kernel takes at most {MAX_ROWS}")
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    N = q.shape[0]
    q = q.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y.reshape(*x.shape[:-1], N)
    block_m = max(16, next_pow2(M))
    launch = dict(num_warps=tile.num_warps, num_stages=tile.num_stages)
    if tile.layout == "rows_major":
        _rows_major_kernel[(cdiv(N, tile.block_n),)](rows, q, scale, y, M, N, K, rows.stride(0), BLOCK_M=block_m,
                                                      BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, **launch)
        return y.reshape(*x.shape[:-1], N)
    k_per_split = cdiv(cdiv(K, tile.split_k), tile.block_k) * tile.block_k
    split = cdiv(K, k_per_split)
    part = torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1 else y
    _swapped_kernel[(cdiv(N, tile.block_n), split)](rows, q, scale, y, part, M, N, K, rows.stride(0), k_per_split,
                                                    BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                                                    SPLIT=split, **launch)
    if split > 1:
        block = 1024
        _sum_splits_kernel[(cdiv(M * N, block),)](part, scale, y, M, N, SPLIT=split, BLOCK=block, num_warps=4)
    return y.reshape(*x.shape[:-1], N)
