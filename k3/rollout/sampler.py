"""Per-request sampling: temperature, top-k, top-p with a request-owned torch.Generator, so a sample depends only
on its own logits and seed (never on what else is in the batch)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

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
    zero-weight entries are never drawn. (torch.multinomial's CPU path draws an exponential for every entry of
    the vocabulary, which dominated the engine's host time per sampled token.)"""
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
    x = _host_logits(logits)
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


@dataclass(eq=False)
class NextLogits:
    """One position's next-token logits as the engine hands them to sampling: `row` [vocab] (on the device, or a
    host copy) and, for CUDA rows, the greedy pick (token, log-prob) computed on the device with the other rows of
    its call (`next_logits`). The host copy (fp32, what temperature > 0 samples from) is made on first need."""
    row: torch.Tensor
    greedy: tuple[int, float] | None = None
    _host: torch.Tensor | None = field(default=None, repr=False)

    def host(self) -> torch.Tensor:
        if self._host is None:
            self._host = self.row.detach().float().cpu()
        return self._host

    def clone(self) -> "NextLogits":
        """A copy that outlives the forward's output (the prefix cache keeps a prompt end's logits)."""
        return NextLogits(self.row.detach().clone(), self.greedy, self._host)


def next_logits(rows: torch.Tensor, on_host: list[bool]) -> list[NextLogits]:
    """rows [R, vocab] of one forward (or one acceptance-walk depth) -> one NextLogits per row. On CUDA every row's
    greedy pick comes from one `k3_kernels.sampling.greedy_pick` launch (a row's pick does not depend on the other
    rows, so plain decoding and speculative verifies report the same bits) and only the rows with `on_host[r]`
    (temperature > 0) are copied to the host, in one copy. On CPU the rows are the host copy and greedy picks are
    made by `sample` from it (argmax, log-softmax)."""
    if not rows.is_cuda:
        host = rows.detach().float()
        return [NextLogits(host[r], None, host[r]) for r in range(rows.shape[0])]
    from k3_kernels.sampling import greedy_pick
    tok, lp = greedy_pick(rows)
    both = torch.stack([tok.to(torch.float64), lp.to(torch.float64)]).cpu()   # one copy (ids < 2^53, fp32 exact)
    picks = [(int(t), float(p)) for t, p in zip(both[0].tolist(), both[1].tolist())]
    want = [r for r, h in enumerate(on_host) if h]
    host = rows[want].detach().float().cpu() if want else None
    out = [NextLogits(row, pick) for row, pick in zip(rows.unbind(0), picks)]   # one op for every row's view
    for i, r in enumerate(want):
        out[r]._host = host[i]
    return out


def _host_logits(logits: "torch.Tensor | NextLogits") -> torch.Tensor:
    return logits.host() if isinstance(logits, NextLogits) else logits.detach().float().cpu()


def sample(logits: "torch.Tensor | NextLogits", params: SamplingParams, gen: torch.Generator
           ) -> tuple[int, float, float]:
    """logits [vocab] -> (token, log p(token) under the full softmax at temperature 1, log p(token) under the
    distribution sampled from: tempered and truncated; 0.0 for greedy). Greedy from a NextLogits with a device pick
    (CUDA) is that pick."""
    if isinstance(logits, NextLogits) and params.temperature == 0.0 and logits.greedy is not None:
        return logits.greedy[0], logits.greedy[1], 0.0
    if params.temperature == 0.0:
        x = _host_logits(logits)
        tok = int(torch.argmax(x))
        return tok, float(torch.log_softmax(x, dim=-1)[tok]), 0.0
    full, logp = sampling_logprobs(logits, params)
    tok = draw(logp.exp(), gen)
    return tok, float(full[tok]), float(logp[tok])
