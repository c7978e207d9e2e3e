"""Spec of the greedy pick (`k3_kernels.sampling.greedy_pick`): for each row of logits x [R, V], the first index of
its maximum and that token's log-probability under the full softmax,

    tok = min{i : x_i = max x},   log p(tok) = x_tok - logsumexp(x) = -log sum_i exp(x_i - max x).
"""
from __future__ import annotations

import torch


def naive_greedy_pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] -> (tok [R] int64, logprob [R] fp64)."""
    x = logits.double()
    m = x.max(dim=-1).values
    tok = torch.stack([torch.nonzero(row == mx)[0, 0] for row, mx in zip(x, m)]) if len(x) else \
        torch.zeros(0, dtype=torch.long, device=x.device)
    return tok, -torch.log(torch.exp(x - m[:, None]).sum(-1))
