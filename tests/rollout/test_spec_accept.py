"""Speculative rejection sampling (k3/rollout/spec/accept.py): over many seeds the emitted tokens are distributed as
the target's own samples (the first token as p_0; the second, given the first draft was kept, as p_1), for point
-mass drafts (n-gram) and sampled drafts with a proposal q; the greedy rule keeps exactly the matching prefix; and
in the engine, sampled spec decoding and plain decoding give the same token frequencies."""
import math

import pytest
import torch

from k3.rollout import Engine, SamplingParams
from k3.rollout.spec.accept import accept_at_node, accept_greedy, accept_sampled, sampling_logprobs
from k3.rollout.spec.tree import build_tree

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


@pytest.mark.parametrize("children", [[0, 1], [1, 0, 5], [4, 3, 2], [2]])   # likely first, top-k-truncated 4
def test_recursive_rejection_over_siblings_keeps_the_target_distribution(children):
    """Token trees: the walk tries the siblings in order, each against the residual of the ones rejected; the
    emitted token is distributed as p, and a child the target cannot sample (top-k) is never taken."""
    logits, params, p = _target()
    counts = torch.zeros(V)
    took = torch.zeros(len(children) + 1)
    for seed in range(N):
        em, i = accept_at_node(logits[0], children, params, torch.Generator().manual_seed(seed), match=False)
        counts[em.token] += 1
        took[len(children) if i is None else i] += 1
        assert (i is None) == (em.token not in children) and (i is None or children[i] == em.token)
    assert _max_z(counts, p[0]) < 4.5, counts
    if 4 in children:
        assert took[children.index(4)] == 0
    # one child: accept_sampled's rule, draw for draw
    for seed in range(50):
        a = accept_at_node(logits[0], children[:1], params, torch.Generator().manual_seed(seed), match=False)[0]
        b = accept_sampled(logits[:1], children[:1], None, params, torch.Generator().manual_seed(seed))[0]
        assert (a.token, a.logprob, a.sampling_logprob) == (b.token, b.logprob, b.sampling_logprob)


def test_greedy_and_match_walk_into_the_child_carrying_the_token():
    logits, params, _ = _target()
    greedy = SamplingParams(temperature=0.0)
    assert accept_at_node(logits[0], [3, 0], greedy, None, match=False)[1] == 1   # argmax 0: the second child
    assert accept_at_node(logits[0], [3, 2], greedy, None, match=False)[1] is None
    from k3.rollout.sampler import sample
    for seed in range(20):
        tok = sample(logits[0], params, torch.Generator().manual_seed(seed))[0]
        e, i = accept_at_node(logits[0], [5, tok], params, torch.Generator().manual_seed(seed), match=True)
        assert e.token == tok and i == (0 if tok == 5 else 1)


def test_build_tree_merges_paths_within_the_shape():
    t = build_tree([[1, 2, 3], [1, 4], [5, 6, 7, 8], [9]], branching=2, depth=3, max_nodes=14)
    assert t.tokens == (1, 2, 3, 4, 5, 6, 7) and t.parents == (-1, 0, 1, 0, -1, 4, 5)   # [9]: a third root child
    assert t.fits(2, 3) and not t.fits(1, 3) and t.depth == 3
    mask = t.ancestor_mask()   # position 0 is the pending token, position i + 1 node i
    assert mask[3].tolist() == [True, True, True, True, False, False, False, False]
    assert mask[5].tolist() == [True, False, False, False, False, True, False, False]
    assert len(build_tree([[1, 2, 3], [1, 4], [5, 6, 7, 8]], 2, 3, max_nodes=4)) == 4


def test_greedy_keeps_the_matching_prefix_and_the_targets_logprobs():
    logits, params, _ = _target()
    greedy = SamplingParams(temperature=0.0)
    em = accept_greedy(logits, [0, 1], greedy)                 # argmaxes are 0, 1, 5: all kept, bonus 5
    assert [e.token for e in em] == [0, 1, 5]
    assert [e.logprob for e in em] == [float(torch.log_softmax(lg, -1)[t]) for lg, t in zip(logits, [0, 1, 5])]
    assert [e.token for e in accept_greedy(logits, [0, 3], greedy)] == [0, 1]
    assert [e.token for e in accept_greedy(logits, [2, 1], greedy)] == [0]


class _Argmax:
    """Drafts plain greedy decoding's continuation (high-probability tokens at a low temperature); trees put a
    decoy sibling before it at every depth."""

    def __init__(self, refs, vocab=512):
        self.refs, self.vocab = refs, vocab

    def propose(self, context, k):
        for ref in self.refs:
            if len(ref) > len(context) and ref[:len(context)] == context:
                return list(ref[len(context):len(context) + k])
        return []

    def propose_tree(self, context, branching, depth, max_nodes):
        ref = self.propose(context, depth)
        paths = []
        for d in range(len(ref)):
            paths += [ref[:d] + [(ref[d] + 1) % self.vocab], ref]
        return build_tree(paths, branching, depth, max_nodes)


@pytest.mark.parametrize("spec", ["ngram:3", "ngram:2x2"])
def test_engine_token_frequencies_match_plain_decoding(model, spec):
    """Many seeds, sampled at temperature 0.05: the frequencies of the 2nd and 3rd tokens (positions where drafts
    are accepted and rejected) agree between plain decoding and spec decoding (two-sample chi-square); chains and
    token trees (recursive rejection over the siblings)."""
    prompt = rand_tokens(12, 41) * 2
    greedy = Engine(model, prefix_cache=False, **SMALL).generate([prompt], SamplingParams(temperature=0.0,
                                                                                         max_tokens=4))
    refs = [prompt + greedy[0].token_ids]
    cfg = dict(SMALL, decode_batch=8, max_running=32, device_states=160)
    runs = {}
    for spec in (None, spec):
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
        b = [t[pos] for t in runs[spec]]
        cats = sorted(set(a) | set(b))
        chi2 = 0.0
        for c in cats:
            ca, cb = a.count(c), b.count(c)
            chi2 += (ca - cb) ** 2 / (ca + cb)
        dof = max(len(cats) - 1, 1)
        # p ~ 1e-4 bound for a chi-square with `dof` degrees of freedom (Wilson-Hilferty)
        bound = dof * (1 - 2 / (9 * dof) + 3.72 * math.sqrt(2 / (9 * dof))) ** 3
        assert chi2 < bound, (pos, chi2, bound, cats)
