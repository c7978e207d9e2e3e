"""RMSNorm module with the checkpoint's parameter name (`weight`)."""
from __future__ import annotations

import torch
from torch import nn

from k3.model import ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)
