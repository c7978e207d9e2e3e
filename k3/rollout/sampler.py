"""Per-request sampling: temperature, top-k, top-p with a request-owned torch.Generator, so a sample depends only
on its own logits and seed (never on what else is in the batch)."""
from __future__ import annotations

import math

import torch

from k3.rollout.types import SamplingParams

_MIX = 0x9E3779B97F4A7C15


def sample_generator(seed: int, index: int) -> torch.Generator:
    """Generator of sample `index` of a request seeded with `seed` (CPU: draws are device independent)."""
    g = torch.Generator(device="cpu")
    g.manual_seed((seed * _MIX + index * 0xBF58476D1CE4E5B9 + 1) % (1 << 63))
    return g


def draw(weights: torch.Tensor, gen: torch.Generator | None) -> int:
    """An index drawn with probability proportional to `weights` [n] (>= 0, positive finite sum; they need not be
    normalised) by inverting the float64 cumulative sum at one uniform from `gen`: one random number a draw, and
    zero-weight entries are never drawn. (torch.multinomial's CPU path draws an exponential for every entry:
    ~2.6 ms for a 32K vocabulary on one thread, the engine's host time per sampled token.)"""
    cdf = torch.cumsum(weights.detach().to(torch.float64), 0)
    total = float(cdf[-1])
    if not (total > 0 and math.isfinite(total)):
        raise ValueError(f"weights: need a positive finite sum, got {total}")
    u = torch.rand(1, generator=gen, dtype=torch.float64) * total
    i = int(torch.searchsorted(cdf, u, right=True))   # the first index whose cumulative weight exceeds u
    if i >= len(cdf):   # u rounded up to the total: the last entry with weight
        i = int(torch.nonzero(weights > 0)[-1])
    return i


def sampling_logprobs(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [vocab] -> (log-softmax at temperature 1, log of the distribution sampled from: tempered by
    `params.temperature` > 0, truncated by top-k and top-p). Speculative acceptance (k3.rollout.spec.accept) reads
    the same tensors, so equal tokens get bitwise equal log-probs."""
    x = logits.detach().float().cpu()
    full = torch.log_softmax(x, dim=-1)
    if params.temperature == 1.0 and not (params.top_k and params.top_k < x.numel()) and params.top_p >= 1.0:
        return full, full   # untempered, untruncated: the same tensor (x / 1.0 is x, bit for bit)
    z = x / params.temperature
    if params.top_k and params.top_k < z.numel():
        kth = torch.topk(z, params.top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    if params.top_p < 1.0:
        order = torch.argsort(z, descending=True, stable=True)
        probs = torch.softmax(z[order], dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        z = z.clone()
        z[order[drop]] = float("-inf")
    return full, torch.log_softmax(z, dim=-1)


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> tuple[int, float, float]:
    """logits [vocab] -> (token, log p(token) under the full softmax at temperature 1, log p(token) under the
    distribution sampled from: tempered and truncated; 0.0 for greedy)."""
    if params.temperature == 0.0:
        x = logits.detach().float().cpu()
        tok = int(torch.argmax(x))
        return tok, float(torch.log_softmax(x, dim=-1)[tok]), 0.0
    full, logp = sampling_logprobs(logits, params)
    tok = draw(logp.exp(), gen)
    return tok, float(full[tok]), float(logp[tok])
