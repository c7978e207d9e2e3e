"""Input validation shared by the RL losses: every error is a ValueError that names the tensor."""
from __future__ import annotations

import torch


def token_tensor(name: str, t: object, like: torch.Tensor | None = None, like_name: str = "logp") -> torch.Tensor:
    """Check that `t` is a floating [B, T] tensor (shaped and placed like `like`) and return it as fp32 or fp64."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be [B, T], got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor of log-probs, got dtype {t.dtype}")
    if like is not None:
        if t.shape != like.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} does not match {like_name} shape {tuple(like.shape)}")
        if t.device != like.device:
            raise ValueError(f"{name} is on {t.device} but {like_name} is on {like.device}")
    if t.shape[0] == 0 or t.shape[1] == 0:
        raise ValueError(f"{name} is empty (shape {tuple(t.shape)}): no sequences or no tokens")
    return t if t.dtype == torch.float64 else t.float()


def mask_tensor(name: str, m: object, like: torch.Tensor, like_name: str = "logp") -> torch.Tensor:
    """Check a [B, T] 0/1 (or bool) mask shaped like `like`; return it as bool."""
    if not isinstance(m, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(m).__name__}")
    if m.shape != like.shape:
        raise ValueError(f"{name} shape {tuple(m.shape)} does not match {like_name} shape {tuple(like.shape)}")
    if m.device != like.device:
        raise ValueError(f"{name} is on {m.device} but {like_name} is on {like.device}")
    if m.dtype == torch.bool:
        return m
    bad = (m != 0) & (m != 1)
    if bool(bad.any()):
        raise ValueError(f"{name} must hold only 0/1 (or bool); found {int(bad.sum())} other values")
    return m != 0


def finite_at(name: str, t: torch.Tensor, mask: torch.Tensor) -> None:
    """Raise if `t` has NaN/inf where `mask` is set (padding outside the mask may hold anything)."""
    bad = ~torch.isfinite(t.detach()) & mask
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name} has {int(bad.sum())} NaN/inf values at response tokens (first at index {first})")


def nonempty_rows(name: str, mask: torch.Tensor) -> None:
    """Raise if a row of `mask` selects no token (an empty response)."""
    empty = ~mask.any(dim=-1)
    if bool(empty.any()):
        rows = empty.nonzero().flatten().tolist()
        raise ValueError(f"{name} has empty responses (no response tokens) in rows {rows[:8]}")


def band(name: str, b: tuple[float, float] | None) -> tuple[float, float] | None:
    """Check a ratio band (low, high) with 0 <= low <= 1 <= high."""
    if b is None:
        return None
    try:
        low, high = (float(x) for x in b)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a (low, high) pair of floats or None, got {b!r}") from None
    if not (0.0 <= low <= 1.0 <= high):
        raise ValueError(f"{name} must satisfy 0 <= low <= 1 <= high, got ({low}, {high})")
    return low, high
