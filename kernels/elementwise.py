"""Elementwise math whose result for an element does not depend on where the element sits in its tensor, on CPU.

ATen's CPU elementwise loops run SIMD (Sleef) over the body of a tensor and a scalar loop (libm) over the last
`n mod 2 * Vec::size()` elements; for transcendental functions (exp, log, sigmoid, ...) the two differ in the last
bit. So the same values give different bits alone and packed beside other sequences (with AVX2 the body/tail split
falls elsewhere than with AVX-512: CI's machines and ours differ). `position_invariant(fn, x)` runs `fn` over x's
elements in pieces of one fixed length, a multiple of every SIMD width and below ATen's parallel grain (so no thread
split either), zero-padded at the end: every element takes the vector path. CUDA kernels have no tails: fn runs as
is there."""
from __future__ import annotations

from typing import Callable

import torch

PIECE = 8192  # elements per call: a multiple of 2 * Vec::size() for every dtype and ISA, < at::internal::GRAIN_SIZE


def position_invariant(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise fn, each element's bits independent of x's size and of the element's offset;
    differentiable (the pieces are views and one cat)."""
    if x.device.type != "cpu" or x.numel() == 0:
        return fn(x)
    flat = x.reshape(-1)
    n = flat.numel()
    pad = (-n) % PIECE
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    pieces = [fn(flat[i:i + PIECE]) for i in range(0, flat.numel(), PIECE)]
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return out[:n].view(x.shape)
