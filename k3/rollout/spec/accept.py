"""Which draft tokens the target accepts, and the tokens a verify emits.

Greedy: draft token t+1 is kept while it equals the target's argmax after position t; then the target's own token
(correction or bonus). Temperature > 0: standard speculative rejection sampling (Leviathan et al. 2023, Chen et al.
2023): accept draft d with probability min(1, p(d) / q(d)), else draw from norm(max(p - q, 0)); after a fully
accepted draft, one bonus token from p. The emitted tokens are then distributed exactly as the target's own samples.
`p` is the distribution plain decoding samples from (temperature, top-k, top-p: the same ops as
k3.rollout.sampler.sample), and the reported log-probs are the target's, computed as plain decoding computes them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from k3.rollout.sampler import draw, sample, sampling_logprobs  # noqa: F401 (re-exported for the tests)
from k3.rollout.types import SamplingParams


@dataclass
class Emitted:
    token: int
    logprob: float            # log p(token) under the target's full softmax at temperature 1
    sampling_logprob: float   # log p(token) under the distribution sampled from (0.0 for greedy)


def accept_greedy(logits: list[torch.Tensor], draft: list[int], params: SamplingParams) -> list[Emitted]:
    """logits[t] after verify position t (t = 0: the pending token; t = j: draft token j); len = len(draft) + 1.
    The target's argmax at each position, kept while it equals the draft (matching without a generator)."""
    return accept_matching(logits, draft, params, None)


def accept_matching(logits: list[torch.Tensor], draft: list[int], params: SamplingParams,
                    gen: torch.Generator) -> list[Emitted]:
    """Each position's token drawn as plain decoding draws it (`sample`, the request's generator); keep going while
    it equals the draft. Bitwise plain decoding's samples; for point-mass drafts each draft token is kept with
    probability p(d), as under rejection sampling."""
    out = []
    for t, lg in enumerate(logits):
        tok, lp, slp = sample(lg, params, gen)
        out.append(Emitted(tok, lp, slp))
        if t >= len(draft) or tok != draft[t]:
            break
    return out


def accept_sampled(logits: list[torch.Tensor], draft: list[int], draft_probs: list[torch.Tensor] | None,
                   params: SamplingParams, gen: torch.Generator) -> list[Emitted]:
    """Rejection sampling; draft_probs[t] is the drafter's distribution q for draft token t (None: a point mass on
    each draft token, as the n-gram drafter's)."""
    out = []
    for t, lg in enumerate(logits):
        full, logp = sampling_logprobs(lg, params)
        p = logp.exp()
        if t >= len(draft):   # the draft was accepted in full: the bonus token, from p
            tok = draw(p, gen)
            out.append(Emitted(tok, float(full[tok]), float(logp[tok])))
            break
        d = draft[t]
        q = draft_probs[t] if draft_probs is not None else None
        q_d = 1.0 if q is None else float(q[d])
        u = float(torch.rand((), generator=gen))
        if q_d > 0 and u * q_d < float(p[d]):   # u < p(d) / q(d)
            out.append(Emitted(d, float(full[d]), float(logp[d])))
            continue
        if q is None:
            residual = p.clone()
            residual[d] = 0.0
        else:
            residual = (p - q.float().cpu()).clamp_min(0.0)
        tok = draw(residual, gen)   # draw normalises
        out.append(Emitted(tok, float(full[tok]), float(logp[tok])))
        break
    return out


def accept_at_node(logits: torch.Tensor, children: list[int], params: SamplingParams, gen: torch.Generator | None,
                   match: bool) -> tuple[Emitted, int | None]:
    """One step of the acceptance walk over a token tree: at a node with the target's `logits`, the token emitted
    there and the index (into `children`, the child nodes' tokens in preference order) of the child the walk moves
    to, None when it stops there (a correction, or the bonus token below a leaf).

    Greedy: the target's argmax; the walk continues into the child carrying it. MATCH: plain decoding's own draw
    (the request's generator), continuing into the child carrying it: bitwise plain decoding's samples.
    REJECTION (temperature > 0): recursive rejection sampling over the siblings (SpecInfer, Miao et al. 2024; the
    multi-draft form of Leviathan et al. 2023 for point-mass drafts): child c_1 is accepted with probability
    r_1(c_1) = p(c_1); if rejected, r_2 = r_1 with c_1 removed, renormalised, and c_2 is accepted with probability
    r_2(c_2); ...; if every child is rejected the token is drawn from the last residual. The emitted token is
    distributed as p exactly (each step is a draw from p conditioned on not being the rejected tokens), for one
    child it is `accept_sampled`'s rule, draw for draw. Log-probs are the target's (`sampling_logprobs`)."""
    if params.temperature == 0.0 or match:
        tok, lp, slp = sample(logits, params, None if params.temperature == 0.0 else gen)
        return Emitted(tok, lp, slp), (children.index(tok) if tok in children else None)
    full, logp = sampling_logprobs(logits, params)
    residual = logp.exp()
    for i, c in enumerate(children):
        u = float(torch.rand((), generator=gen))
        mass = 1.0 if i == 0 else float(residual.sum())
        if mass > 0 and u * mass < float(residual[c]):
            return Emitted(c, float(full[c]), float(logp[c])), i
        residual = residual.clone()
        residual[c] = 0.0
    tok = draw(residual, gen)   # draw normalises
    return Emitted(tok, float(full[tok]), float(logp[tok])), None
