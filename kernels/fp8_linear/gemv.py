"""Weight-only FP8 linear (spec: naive.py) for a few rows: each program owns BLOCK_N output columns for every row
(the rows padded to one 16-row tile), walks K in BLOCK_K steps in order (no split, no atomics: the same bits on
every call), upcasts the e4m3 weight tile to the activations' dtype (exact: e4m3 values are bf16 values) and
accumulates in fp32; the row scales multiply the sums at the end. Memory-bound: it reads each weight byte once,
half of a bf16 weight's bytes."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3_kernels.fp8_linear.naive import MAX_ROWS, check_fp8_linear_args
from k3_kernels.launch import cdiv, next_pow2


@triton.jit
def _fp8_linear_kernel(x_ptr, q_ptr, s_ptr, y_ptr, M, N, K, x_stride, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
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


def fp8_weight_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block_n: int = 32,
                      block_k: int = 256, num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """x [..., K] (bf16 or fp32, at most MAX_ROWS rows), q [N, K] e4m3, scale [N] fp32 -> [..., N] in x's dtype."""
    check_fp8_linear_args(x, q, scale)
    rows = x.reshape(-1, x.shape[-1])
    M, K = rows.shape
    if M > MAX_ROWS:
        raise ValueError(f"x: {M} rows, the FP8 weight-only kernel takes at most {MAX_ROWS}")
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    N = q.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        _fp8_linear_kernel[(cdiv(N, block_n),)](rows, q.contiguous(), scale, y, M, N, K, rows.stride(0),
                                                BLOCK_M=max(16, next_pow2(M)), BLOCK_N=block_n, BLOCK_K=block_k,
                                                num_warps=num_warps, num_stages=num_stages)
    return y.reshape(*x.shape[:-1], N)
