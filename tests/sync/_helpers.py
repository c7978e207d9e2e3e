"""Shared fixtures for k3.sync tests: small mixed-dtype states and RL-like perturbations."""
from __future__ import annotations

import torch


def make_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """A small state dict covering the dtypes the codec must carry bit for bit."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": (torch.randn(64, 48, generator=g) * 0.02).to(torch.bfloat16),
        "layers.0.w": (torch.randn(300, 7, generator=g) * 0.05).to(torch.bfloat16),
        "layers.0.norm": torch.ones(48, dtype=torch.float32),
        "layers.0.fp8": torch.randn(129, generator=g).to(torch.float8_e4m3fn),
        "layers.0.fp8b": torch.randn(10, generator=g).to(torch.float8_e5m2),
        "layers.0.half": torch.randn(33, generator=g).to(torch.float16),
        "layers.0.f64": torch.randn(5, generator=g, dtype=torch.float64),
        "ids": torch.randint(-1000, 1000, (17,), generator=g, dtype=torch.int64),
        "counts": torch.randint(0, 100, (9,), generator=g, dtype=torch.int32),
        "mask": torch.rand(11, generator=g) > 0.5,
        "bytes": torch.randint(0, 256, (13,), generator=g, dtype=torch.uint8),
        "scalar": torch.tensor(3.5, dtype=torch.bfloat16),
        "empty": torch.empty(0, 4, dtype=torch.bfloat16),
    }


def step(state: dict[str, torch.Tensor], seed: int, lr: float = 1e-3) -> dict[str, torch.Tensor]:
    """An RL-like update: floating tensors get a small relative nudge (a few bf16 values change)."""
    g = torch.Generator().manual_seed(1000 + seed)
    out = {}
    for k, v in state.items():
        if v.is_floating_point() and v.numel():
            out[k] = (v.double() * (1 + lr * torch.randn(v.shape, generator=g, dtype=torch.float64))).to(v.dtype)
        elif v.dtype in (torch.int64, torch.int32):
            out[k] = v + (torch.rand(v.shape, generator=g) < 0.2).to(v.dtype)
        else:
            out[k] = v.clone()
    return out


def clone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


def chain(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Versions 0..n-1 of a state."""
    states = [make_state(seed)]
    for i in range(1, n):
        states.append(step(states[-1], i))
    return states


def frame_offsets(payload: bytes) -> list[tuple[str, int, int]]:
    """(tensor, start of frame record, start of frame data) for every frame of a payload."""
    from k3.sync.codec import _Source, read_manifest
    from k3.sync.format import FRAME

    src = _Source(payload)
    man = read_manifest(src)
    pos, out = src.pos, []
    for e in man.tensors:
        for _ in range(e.frames):
            comp_len = FRAME.unpack(payload[pos:pos + FRAME.size])[5]
            out.append((e.name, pos, pos + FRAME.size + 8))
            pos += FRAME.size + 8 + comp_len
    return out


def with_flipped_bit(state: dict[str, torch.Tensor], name: str, byte: int = 0) -> dict[str, torch.Tensor]:
    """A copy of `state` (on its device) whose tensor `name` has the lowest bit of raw byte `byte` flipped:
    same names, dtypes and shapes, different bytes (a wrong base under the same version number)."""
    out = clone(state)
    out[name].reshape(-1).view(torch.uint8)[byte] ^= 1
    return out


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Same names, dtypes, shapes and raw bytes, compared where the tensors live (CPU or CUDA)."""
    if set(a) != set(b):
        return False
    for k, x in a.items():
        y = b[k].to(x.device)
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            return False
    return True
