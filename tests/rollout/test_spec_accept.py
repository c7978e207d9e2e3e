"""Speculative rejection sampling (k3/rollout/spec/accept.py): over many seeds the emitted tokens are distributed as
the target's own samples (the first token as p_0; the second, given the first draft was kept, as p_1), for point
-mass drafts (n-gram) and sampled drafts with a proposal q; the greedy rule keeps exactly the matching prefix; and
in the engine, sampled spec decoding and plain decoding give the same token frequencies."""
import math

import pytest
import torch

from k3.rollout import Engine, SamplingParams
from k3.rollout.spec.accept import accept_greedy, accept_sampled, sampling_logprobs

from _engine_helpers import SMALL, rand_tokens

V = 6
N = 6000


def _max_z(counts: torch.Tensor, p: torch.Tensor) -> float:
    """Largest |count - n p| / sqrt(n p (1 - p)) over the tokens (binomial z-scores)."""
    n = float(counts.sum())
    sd = (n * p * (1 - p)).clamp_min(1e-12).sqrt()
    return float(((counts - n * p).abs() / sd).max())


def _target():
    logits = [torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 0.3]), torch.tensor([0.0, 1.5, -0.5, 1.0, 0.2, 0.0]),
              torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 2.0])]
    params = SamplingParams(temperature=0.8, top_k=5, seed=0)
    p = [sampling_logprobs(lg, params)[1].exp() for lg in logits]
    return logits, params, p


@pytest.mark.parametrize("draft", [[0, 1], [2, 2], [4, 3]])   # likely, less likely, truncated away (top_k)
def test_point_mass_drafts_keep_the_target_distribution(draft):
    logits, params, p = _target()
    first = torch.zeros(V)
    second = torch.zeros(V)
    for seed in range(N):
        em = accept_sampled(logits, draft, None, params, torch.Generator().manual_seed(seed))
        first[em[0].token] += 1
        if em[0].token == draft[0]:
            second[em[1].token] += 1
    assert _max_z(first, p[0]) < 4.5, first
    if p[0][draft[0]] > 0.05:
        assert _max_z(second, p[1]) < 4.5, second
    if p[0][draft[0]] == 0:   # a draft the target cannot sample is never accepted
        assert first[draft[0]] == 0


def test_sampled_drafts_with_a_proposal_keep_the_target_distribution():
    logits, params, p = _target()
    q = torch.softmax(torch.tensor([0.0, 2.0, 0.0, 1.0, 0.0, 0.5]), -1)
    first = torch.zeros(V)
    for seed in range(N):
        g = torch.Generator().manual_seed(seed)
        draft = [int(torch.multinomial(q, 1, generator=g)), int(torch.multinomial(q, 1, generator=g))]
        em = accept_sampled(logits, draft, [q, q], params, g)
        first[em[0].token] += 1
    assert _max_z(first, p[0]) < 4.5, first


def test_greedy_keeps_the_matching_prefix_and_the_targets_logprobs():
    logits, params, _ = _target()
    greedy = SamplingParams(temperature=0.0)
    em = accept_greedy(logits, [0, 1], greedy)                 # argmaxes are 0, 1, 5: all kept, bonus 5
    assert [e.token for e in em] == [0, 1, 5]
    assert [e.logprob for e in em] == [float(torch.log_softmax(lg, -1)[t]) for lg, t in zip(logits, [0, 1, 5])]
    assert [e.token for e in accept_greedy(logits, [0, 3], greedy)] == [0, 1]
    assert [e.token for e in accept_greedy(logits, [2, 1], greedy)] == [0]


class _Argmax:
    """Drafts plain greedy decoding's continuation (high-probability tokens at a low temperature)."""

    def __init__(self, refs):
        self.refs = refs

    def propose(self, context, k):
        for ref in self.refs:
            if len(ref) > len(context) and ref[:len(context)] == context:
                return list(ref[len(context):len(context) + k])
        return []


def test_engine_token_frequencies_match_plain_decoding(model):
    """Many seeds, sampled at temperature 0.05: the frequencies of the 2nd and 3rd tokens (positions where drafts
    are accepted and rejected) agree between plain decoding and spec decoding (two-sample chi-square)."""
    prompt = rand_tokens(12, 41) * 2
    greedy = Engine(model, prefix_cache=False, **SMALL).generate([prompt], SamplingParams(temperature=0.0,
                                                                                         max_tokens=4))
    refs = [prompt + greedy[0].token_ids]
    cfg = dict(SMALL, decode_batch=8, max_running=32, device_states=160)
    runs = {}
    for spec in (None, "ngram:3"):
        eng = Engine(model, prefix_cache=True, speculative=spec, **cfg)
        if spec:
            eng.spec.drafter = _Argmax(refs)
        comps = eng.generate([prompt] * 8, [SamplingParams(temperature=0.05, seed=100 + i, max_tokens=4, n=24)
                                            for i in range(8)])
        runs[spec] = [tuple(c.token_ids[:3]) for c in comps]
        if spec:
            assert eng.stats["spec_accepted_tokens"] > 0
            assert eng.stats["spec_draft_tokens"] > eng.stats["spec_accepted_tokens"]
    for pos in (1, 2):
        a = [t[pos] for t in runs[None]]
        b = [t[pos] for t in runs["ngram:3"]]
        cats = sorted(set(a) | set(b))
        chi2 = 0.0
        for c in cats:
            ca, cb = a.count(c), b.count(c)
            chi2 += (ca - cb) ** 2 / (ca + cb)
        dof = max(len(cats) - 1, 1)
        # p ~ 1e-4 bound for a chi-square with `dof` degrees of freedom (Wilson-Hilferty)
        bound = dof * (1 - 2 / (9 * dof) + 3.72 * math.sqrt(2 / (9 * dof))) ** 3
        assert chi2 < bound, (pos, chi2, bound, cats)
