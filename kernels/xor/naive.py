"""Plain-torch reference for the byte-wise XOR used by XOR-delta weight sync (the op's specification)."""
from __future__ import annotations

import torch


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a contiguous tensor as a flat uint8 view (any dtype, including bf16/fp8/bool)."""
    if not t.is_contiguous():
        raise ValueError("as_bytes: tensor must be contiguous")
    return t.reshape(-1).view(torch.uint8)


def naive_xor_bytes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """XOR of the raw bytes of two tensors of equal byte size; returns a flat uint8 tensor."""
    ab, bb = as_bytes(a), as_bytes(b)
    if ab.numel() != bb.numel():
        raise ValueError(f"naive_xor_bytes: byte sizes differ ({ab.numel()} vs {bb.numel()})")
    return torch.bitwise_xor(ab, bb)
