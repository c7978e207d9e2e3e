"""Multi-LoRA Triton kernels: SGMV-style shrink and expand over contiguous segments of one adapter (Punica,
arXiv 2310.18547; S-LoRA's MBGMM). A decode batch is the BGMV case: every token its own segment of length 1.

Each program owns BLOCK_M rows of one segment (and, for expand, BLOCK_O output columns) and reduces over the
inner dimension in a fixed order with no atomics: results are deterministic, and a row's value depends only on
its own inputs and its adapter. Spec: `naive.py` (tests/kernels/test_lora_sgmv.py, interpreter on CPU)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3_kernels.launch import cdiv, next_pow2
from k3_kernels.lora.naive import check_lora_args, segments


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, seg_ptr, K, R, x_stride, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_R: tl.constexpr):
    sid = tl.program_id(0)
    start = tl.load(seg_ptr + sid * 3)
    length = tl.load(seg_ptr + sid * 3 + 1)
    slot = tl.load(seg_ptr + sid * 3 + 2).to(tl.int64)
    m0 = tl.program_id(1) * BLOCK_M
    if m0 < length:
        rows = m0 + tl.arange(0, BLOCK_M)
        rmask = rows < length
        r64 = (start + rows).to(tl.int64)
        rr = tl.arange(0, BLOCK_R)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            kmask = kk < K
            x = tl.load(x_ptr + r64[:, None] * x_stride + kk[None, :], mask=rmask[:, None] & kmask[None, :],
                        other=0.0).to(tl.float32)
            a = tl.load(a_ptr + slot * R * K + rr[None, :] * K + kk[:, None],
                        mask=(rr < R)[None, :] & kmask[:, None], other=0.0).to(tl.float32)   # A[slot].T tile
            acc += tl.dot(x, a, input_precision="ieee")
        tl.store(h_ptr + r64[:, None] * R + rr[None, :], acc, mask=rmask[:, None] & (rr < R)[None, :])


@triton.jit
def _expand_kernel(h_ptr, b_ptr, base_ptr, y_ptr, seg_ptr, scale_ptr, O, R, base_stride,
                   BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr):
    sid = tl.program_id(0)
    start = tl.load(seg_ptr + sid * 3)
    length = tl.load(seg_ptr + sid * 3 + 1)
    slot = tl.load(seg_ptr + sid * 3 + 2).to(tl.int64)
    m0 = tl.program_id(1) * BLOCK_M
    if m0 < length:
        rows = m0 + tl.arange(0, BLOCK_M)
        rmask = rows < length
        r64 = (start + rows).to(tl.int64)
        oo = tl.program_id(2) * BLOCK_O + tl.arange(0, BLOCK_O)
        omask = oo < O
        rr = tl.arange(0, BLOCK_R)
        h = tl.load(h_ptr + r64[:, None] * R + rr[None, :], mask=rmask[:, None] & (rr < R)[None, :], other=0.0)
        bt = tl.load(b_ptr + slot * O * R + oo[None, :] * R + rr[:, None], mask=(rr < R)[:, None] & omask[None, :],
                     other=0.0).to(tl.float32)                                                  # B[slot].T tile
        scale = tl.load(scale_ptr + slot)
        m = rmask[:, None] & omask[None, :]
        base = tl.load(base_ptr + r64[:, None] * base_stride + oo[None, :], mask=m, other=0.0).to(tl.float32)
        y = base + scale * tl.dot(h, bt, input_precision="ieee")
        tl.store(y_ptr + r64[:, None] * O + oo[None, :], y.to(y_ptr.dtype.element_ty), mask=m)


def _blocks(max_len: int) -> int:
    return max(16, min(64, next_pow2(max_len)))


def sgmv_lora(x: torch.Tensor, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
              scale: torch.Tensor) -> torch.Tensor:
    """base + per-token LoRA (see naive.naive_multi_lora): x [N, in], base [N, out], A [S, r, in], B [S, out, r],
    slots [N] (-1 = none), scale [S]. Tokens of one adapter should be contiguous (one segment each); any order
    is correct."""
    check_lora_args(x, a, b, slots, scale)
    if base.shape != (x.shape[0], b.shape[1]):
        raise ValueError(f"base: expected [{x.shape[0]}, {b.shape[1]}], got {tuple(base.shape)}")
    N, K = x.shape
    R, O = a.shape[1], b.shape[1]
    if x.stride(1) != 1 or base.stride(1) != 1:
        raise ValueError("x, base: the last dimension must be contiguous")
    a, b = a.contiguous(), b.contiguous()
    scale = scale.to(device=x.device, dtype=torch.float32).contiguous()
    seg = segments(slots).to(x.device)
    y = base.clone() if base.is_contiguous() else base.contiguous().clone()
    if seg.shape[0] == 0:
        return y
    h = torch.zeros(N, R, device=x.device, dtype=torch.float32)
    max_len = int(seg[:, 1].max())
    BM = _blocks(max_len)
    BR = max(16, next_pow2(R))
    _shrink_kernel[(seg.shape[0], cdiv(max_len, BM))](x, a, h, seg, K, R, x.stride(0), BLOCK_M=BM, BLOCK_K=32,
                                                      BLOCK_R=BR)
    BO = 64
    _expand_kernel[(seg.shape[0], cdiv(max_len, BM), cdiv(O, BO))](h, b, base, y, seg, scale, O, R, base.stride(0),
                                                                   BLOCK_M=BM, BLOCK_O=BO, BLOCK_R=BR)
    return y
