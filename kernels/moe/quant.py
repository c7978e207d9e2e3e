"""FP8 weight quantisation (128 x 128 blocks, e4m3) and MXFP4 dequantisation for the expert weights (Triton).

Activations are quantised in the kernels that write them (permute.permute_rows for the permuted rows, the gate/up
GEMM's epilogue for H); weights once per optimizer step (`quantize_weight_fp8`; the layer caches it per weight
version). The published checkpoint stores routed experts as MXFP4 (`mxfp4-pack-quantized`, group 32, E8M0
scales): `dequantize_mxfp4` expands them to bf16 at load (exact), and the layer computes in bf16/FP8 from there;
an MXFP4-weight GEMM (W4A16, as serving stacks do) is not built. Spec: naive.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3_kernels.launch import cdiv
from k3_kernels.moe.naive import MXFP4_GROUP
from k3_kernels.moe.permute import QUANT_BLOCK, e4m3_scales, e4m3_values


@triton.jit
def _quant_weight_kernel(w_ptr, q_ptr, s_ptr, N, K, QB: tl.constexpr):
    e = tl.program_id(2).to(tl.int64)
    nb, kb = tl.program_id(0), tl.program_id(1)
    n = nb * QB + tl.arange(0, QB)
    k = kb * QB + tl.arange(0, QB)
    off = e * N * K + n[:, None].to(tl.int64) * K + k[None, :]
    v = tl.load(w_ptr + off).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(v), axis=1), axis=0)
    scale, inverse = e4m3_scales(amax)
    tl.store(q_ptr + off, e4m3_values(v, inverse).to(q_ptr.dtype.element_ty))
    tl.store(s_ptr + (e * tl.num_programs(0) + nb) * tl.num_programs(1) + kb, scale)


def quantize_weight_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, N, K] (N, K divisible by 128) -> (q e4m3 [E, N, K], scale fp32 [E, N / 128, K / 128])."""
    if w.dim() != 3 or w.shape[1] % QUANT_BLOCK or w.shape[2] % QUANT_BLOCK:
        raise ValueError(f"w: expected [E, N, K] with N, K divisible by {QUANT_BLOCK}, got {tuple(w.shape)}")
    w = w.contiguous()
    E, N, K = w.shape
    q = torch.empty(E, N, K, device=w.device, dtype=torch.float8_e4m3fn)
    s = torch.empty(E, N // QUANT_BLOCK, K // QUANT_BLOCK, device=w.device, dtype=torch.float32)
    if w.numel():
        _quant_weight_kernel[(N // QUANT_BLOCK, K // QUANT_BLOCK, E)](w, q, s, N, K, QB=QUANT_BLOCK, num_warps=8)
    return q, s


@triton.jit
def _mxfp4_kernel(p_ptr, s_ptr, out_ptr, n_bytes, half, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n_bytes
    b = tl.load(p_ptr + i, mask=m, other=0).to(tl.int32)
    row = i // half
    col = (i % half) * 2  # element index of the low nibble
    sc = tl.load(s_ptr + row * (2 * half // GROUP) + col // GROUP, mask=m, other=127).to(tl.float32)
    mult = tl.exp2(sc - 127.0)
    for nib in tl.static_range(2):
        c = (b >> (4 * nib)) & 0xF
        mag = c & 7
        # E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6: codes 0-3 are c / 2, codes 4-7 are 2, 3, 4, 6
        v = tl.where(mag < 4, mag.to(tl.float32) * 0.5, tl.where(mag == 7, 6.0, (mag - 2).to(tl.float32)))
        v = tl.where(c >= 8, -v, v)
        tl.store(out_ptr + row.to(tl.int64) * (2 * half) + col + nib, (v * mult).to(out_ptr.dtype.element_ty),
                 mask=m)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
                     ) -> torch.Tensor:
    """MXFP4 (compressed-tensors mxfp4-pack-quantized) -> dtype; same contract as naive.naive_dequant_mxfp4."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"packed, scales: expected uint8, got {packed.dtype}, {scales.dtype}")
    out_f, half = packed.shape
    if (2 * half) % MXFP4_GROUP or scales.shape != (out_f, 2 * half // MXFP4_GROUP):
        raise ValueError(f"scales: expected [{out_f}, {2 * half // MXFP4_GROUP}] for packed {tuple(packed.shape)}, "
                         f"got {tuple(scales.shape)}")
    out = torch.empty(out_f, 2 * half, device=packed.device, dtype=dtype)
    n = packed.numel()
    if n:
        BLOCK = 1024
        _mxfp4_kernel[(cdiv(n, BLOCK),)](packed.contiguous(), scales.contiguous(), out, n, half, GROUP=MXFP4_GROUP,
                                         BLOCK=BLOCK)
    return out
