"""RMSNorm references (fp32 math, output in the input dtype)."""
from __future__ import annotations

import torch


def naive_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def naive_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None,
                         eps: float = 1e-6) -> torch.Tensor:
    """KDA's output norm (FLA FusedRMSNormGated, activation='sigmoid'): RMSNorm(x) * weight * sigmoid(gate)."""
    y = naive_rms_norm(x.float(), weight, eps) * torch.sigmoid(gate.float())
    return y.to(x.dtype)
