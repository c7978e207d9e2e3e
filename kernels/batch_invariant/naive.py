"""Spec of `batch_invariant_linear`: x @ weight.T (+ bias) with fp32 accumulation, cast to x's dtype."""
from __future__ import annotations

import torch


def naive_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = x.double() @ weight.double().t()
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)
