"""Multi-LoRA reference (the spec of the Triton kernels beside it): Punica's shrink / expand pair
(arXiv 2310.18547; SGMV over contiguous segments of one adapter, BGMV per token).

Adapters are stacked: A [S, r, in], B [S, out, r] (ranks below r padded with zero rows / columns, which adds
exact zeros). Each token i selects slot `slots[i]` (-1: no adapter):

    shrink:  h[i] = x[i] @ A[slots[i]].T                         [N, r]   (0 where slots[i] = -1)
    expand:  y[i] = base[i] + scale[slots[i]] * h[i] @ B[slots[i]].T   [N, out] (base[i] where slots[i] = -1)
"""
from __future__ import annotations

import torch


def check_lora_args(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                    scale: torch.Tensor, check_values: bool = True) -> None:
    """Shapes and dtypes (and, with check_values, the slot range: a device-to-host read)."""
    if x.dim() != 2:
        raise ValueError(f"x: expected [N, in], got {tuple(x.shape)}")
    if a.dim() != 3 or a.shape[2] != x.shape[1]:
        raise ValueError(f"lora_a: expected [S, r, {x.shape[1]}], got {tuple(a.shape)}")
    if b.dim() != 3 or b.shape[0] != a.shape[0] or b.shape[2] != a.shape[1]:
        raise ValueError(f"lora_b: expected [{a.shape[0]}, out, {a.shape[1]}], got {tuple(b.shape)}")
    if slots.dim() != 1 or slots.shape[0] != x.shape[0] or slots.is_floating_point():
        raise ValueError(f"slots: expected an integer [{x.shape[0]}] tensor, got {slots.dtype} {tuple(slots.shape)}")
    if check_values and slots.numel() and (int(slots.min()) < -1 or int(slots.max()) >= a.shape[0]):
        raise ValueError(f"slots: entries must be in [-1, {a.shape[0]}), got [{int(slots.min())}, "
                         f"{int(slots.max())}]")
    if scale.shape != (a.shape[0],):
        raise ValueError(f"scale: expected [{a.shape[0]}] (one per adapter), got {tuple(scale.shape)}")


def naive_lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    h = x.new_zeros(x.shape[0], a.shape[1], dtype=torch.float32)
    for s in torch.unique(slots).tolist():
        if s < 0:
            continue
        pos = (slots == s).nonzero(as_tuple=True)[0]
        h[pos] = x[pos].float() @ a[s].float().t()
    return h


def naive_lora_expand(h: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor,
                      base: torch.Tensor) -> torch.Tensor:
    y = base.float().clone()
    for s in torch.unique(slots).tolist():
        if s < 0:
            continue
        pos = (slots == s).nonzero(as_tuple=True)[0]
        y[pos] += float(scale[s]) * (h[pos].float() @ b[s].float().t())
    return y.to(base.dtype)


def naive_multi_lora(x: torch.Tensor, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                     scale: torch.Tensor) -> torch.Tensor:
    """base + per-token LoRA: expand(shrink(x))."""
    check_lora_args(x, a, b, slots, scale)
    return naive_lora_expand(naive_lora_shrink(x, a, slots), b, slots, scale, base)


def segments(slots: torch.Tensor) -> torch.Tensor:
    """Runs of equal consecutive slots, skipping -1: int32 [n_seg, 3] rows (start, length, slot)."""
    s = slots.long().cpu()
    if s.numel() == 0:
        return torch.zeros(0, 3, dtype=torch.int32)
    change = torch.ones_like(s, dtype=torch.bool)
    change[1:] = s[1:] != s[:-1]
    starts = change.nonzero(as_tuple=True)[0]
    lens = torch.diff(torch.cat([starts, torch.tensor([s.numel()])]))
    seg = torch.stack([starts, lens, s[starts]], dim=1)
    return seg[seg[:, 2] >= 0].to(torch.int32)
