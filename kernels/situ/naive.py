"""SiTU (K3 Eq. 12): soft-capped SwiGLU, [b1 tanh(g/b1) sigmoid(g)] * [b2 tanh(u/b2)], fp32 math."""
from __future__ import annotations

import torch


def naive_situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0,
                       linear_beta: float = 25.0) -> torch.Tensor:
    g, u = gate.float(), up.float()
    y = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))
    return y.to(gate.dtype)
