"""Triton byte-wise XOR of two equally sized buffers (the GPU stage of XOR-delta weight sync).

Buffers are reinterpreted as the widest integer word that divides their byte size (int64, int32, int16
or uint8), so the kernel moves full words; the result is bit-identical to `naive_xor_bytes`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3_kernels.launch import cdiv

from .naive import as_bytes

_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


@triton.jit
def _xor_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask)
    b = tl.load(b_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, a ^ b, mask=mask)


def _word_view(flat: torch.Tensor) -> torch.Tensor:
    """Widest integer view of a flat uint8 tensor whose length and storage offset allow it."""
    n = flat.numel()
    for size, dtype in _WORDS:
        if n % size == 0 and flat.data_ptr() % size == 0:
            return flat.view(dtype)
    return flat


def xor_bytes(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, block: int = 2048) -> torch.Tensor:
    """XOR the raw bytes of `a` and `b` (same byte size, same device) into `out` (flat uint8, allocated if None).

    Returns `out`. Works for any dtype; CUDA tensors, or CPU tensors under TRITON_INTERPRET=1.
    """
    ab, bb = as_bytes(a), as_bytes(b)
    if ab.numel() != bb.numel():
        raise ValueError(f"xor_bytes: byte sizes differ ({ab.numel()} vs {bb.numel()})")
    if ab.device != bb.device:
        raise ValueError(f"xor_bytes: devices differ ({ab.device} vs {bb.device})")
    if out is None:
        out = torch.empty_like(ab)
    elif out.dtype != torch.uint8 or out.numel() != ab.numel() or not out.is_contiguous():
        raise ValueError("xor_bytes: out must be a contiguous uint8 tensor of the inputs' byte size")
    if ab.numel() == 0:
        return out
    aw, bw, ow = _word_view(ab), _word_view(bb), _word_view(out)
    if not (aw.dtype == bw.dtype == ow.dtype):  # alignment differs between buffers: fall back to bytes
        aw, bw, ow = ab, bb, out
    n = aw.numel()
    _xor_kernel[(cdiv(n, block),)](aw, bw, ow, n, BLOCK=block, num_warps=8)
    return out
