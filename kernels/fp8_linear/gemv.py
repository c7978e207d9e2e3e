"""Weight-only FP8 linear (spec: naive.py) for a few rows, two layouts of one memory-bound loop (each reads every
weight byte once, half of a bf16 weight's bytes, upcasts the e4m3 tile to the activations' dtype -- exact: e4m3
values are bf16 values -- and accumulates in fp32 in a fixed order):

* `rows_major`: each program owns BLOCK_N output columns for every row (rows padded to one 16-row tile), the
  activations as the dot's left operand;
* `swapped` (default): y^T = W x^T, the weight tile the dot's left operand (on sm_90 it can stay in registers after
  the upcast; the activations, the small operand, go through shared memory), with an optional split of K into
  `split_k` ranges whose fp32 partial sums a second launch adds in order (no atomics: the same bits on every call,
  and a row's output never depends on the rows beside it). With `f16_operands` (bf16 rows only) a first launch
  writes each row in fp16, scaled by a power of two that brings its largest magnitude into [2^13, 2^14) (exact
  but for elements over 2^27 below the row's largest, which fall into fp16's subnormals), so the weights upcast straight to fp16 -- one
  conversion an element pair instead of e4m3 -> f16 -> f32 -> bf16, whose f16 -> f32 step runs at 16 elements a
  clock an SM, about the HBM rate of e4m3 bytes on the H200 -- and the power of two comes back in the epilogue.

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
    f16_operands: bool = False

    def __post_init__(self):
        if self.layout not in ("swapped", "rows_major"):
            raise ValueError(f"layout: expected 'swapped' or 'rows_major', got {self.layout!r}")
        if self.split_k < 1 or (self.split_k > 1 and self.layout != "swapped"):
            raise ValueError(f"split_k: {self.split_k} (>= 1; above 1 with the swapped layout only)")
        if self.f16_operands and self.layout != "swapped":
            raise ValueError("f16_operands: with the swapped layout only")


# the H200 sweep's best chain of three drafter linears at 8 rows (benchmarks.fp8_linear --sweep ->
# benchmarks/results/fp8_linear_h200_42ca552.json)
DEFAULT_TILE = Fp8LinearTile(block_n=128, block_k=128, num_warps=8, num_stages=3, split_k=4, f16_operands=True)


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
def _pow2(e):
    """2^e for integer e in [-126, 127], built from its exponent bits (exact)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _rows_to_f16_kernel(x_ptr, out_ptr, factor_ptr, K, x_stride, BLOCK_K: tl.constexpr):
    """Row `program_id` of x in fp16 times 2^-e (e: the power of two that brings its largest magnitude into
    [2^13, 2^14); at least -126, so rows below 2^-113 keep their scale short of that), and 2^e to factor_ptr."""
    row = tl.program_id(0)
    big = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_ptr + row * x_stride + kk, mask=kk < K, other=0.0).to(tl.float32)
        big = tl.maximum(big, tl.abs(v))
    amax = tl.max(big, 0)
    # amax in [2^(field - 127), 2^(field - 126)) for its exponent field (normal amax): e = field - 140
    field = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.maximum(field - 140, -126)  # <= 115 for any finite amax: 2^-e and 2^e both normal
    down = _pow2(-e)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_ptr + row * x_stride + kk, mask=kk < K, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * K + kk, (v * down).to(tl.float16), mask=kk < K)
    tl.store(factor_ptr + row, _pow2(e))


@triton.jit
def _swapped_kernel(x_ptr, q_ptr, s_ptr, y_ptr, part_ptr, factor_ptr, M, N, K, x_stride, k_per_split,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                    F16: tl.constexpr, EVEN: tl.constexpr):
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
        if EVEN:   # whole tiles (N, K and the split's range multiples of theirs): the weight loads unmasked
            w = tl.load(q_ptr + cols[:, None].to(tl.int64) * K + kk[None, :])
        else:
            w = tl.load(q_ptr + cols[:, None].to(tl.int64) * K + kk[None, :], mask=cmask[:, None] & kmask[None, :],
                        other=0.0)
        xt = tl.load(x_ptr + rows[None, :] * x_stride + kk[:, None], mask=rmask[None, :] & kmask[:, None], other=0.0)
        acc += tl.dot(w.to(xt.dtype), xt, input_precision="ieee")
    if F16:   # each row's power of two back (exact)
        acc = acc * tl.load(factor_ptr + rows, mask=rmask, other=1.0)[None, :]
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
    f16 = tile.f16_operands and rows.dtype == torch.bfloat16   # fp32 rows would round in fp16
    factor = y
    if f16:
        operand = torch.empty(M, K, dtype=torch.float16, device=x.device)
        factor = torch.empty(M, dtype=torch.float32, device=x.device)
        _rows_to_f16_kernel[(M,)](rows, operand, factor, K, rows.stride(0), BLOCK_K=1024, num_warps=4)
        rows = operand
    _swapped_kernel[(cdiv(N, tile.block_n), split)](rows, q, scale, y, part, factor, M, N, K, rows.stride(0),
                                                    k_per_split, BLOCK_M=block_m, BLOCK_N=tile.block_n,
                                                    BLOCK_K=tile.block_k, SPLIT=split, F16=f16,
                                                    EVEN=N % tile.block_n == 0 and K % k_per_split == 0
                                                    and k_per_split % tile.block_k == 0, **launch)
    if split > 1:
        block = 1024
        _sum_splits_kernel[(cdiv(M * N, block),)](part, scale, y, M, N, SPLIT=split, BLOCK=block, num_warps=4)
    return y.reshape(*x.shape[:-1], N)
