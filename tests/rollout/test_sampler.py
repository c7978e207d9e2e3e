"""k3.rollout.sampler.draw, the engine's one draw per sampled token (and the spec decoder's residual draws): the
frequencies must be the weights', zero-weight entries never drawn, unnormalised weights accepted, the same
generator state the same index, and bad weights refused; one draw must cost one random number, not one per entry
(the engine's host time per sampled token on a 32K vocabulary)."""
import pytest
import torch

from k3.rollout.sampler import draw, sample, sample_generator, sampling_logprobs
from k3.rollout.types import SamplingParams


def test_draw_follows_the_weights_and_never_draws_a_zero():
    w = torch.tensor([0.0, 2.0, 0.0, 6.0, 12.0, 0.0])   # unnormalised; zeros at both ends and inside
    g = torch.Generator().manual_seed(0)
    n = 40_000
    counts = torch.bincount(torch.tensor([draw(w, g) for _ in range(n)]), minlength=len(w)).double()
    assert counts[0] == counts[2] == counts[5] == 0
    expected = w.double() / w.sum() * n
    sd = (expected * (1 - w.double() / w.sum())).sqrt()
    assert ((counts - expected).abs() <= 5 * sd + 1e-9).all(), counts


def test_draw_is_reproducible_and_uses_one_random_number():
    w = torch.rand(32768)
    a, b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert [draw(w, a) for _ in range(5)] == [draw(w, b) for _ in range(5)]
    c = torch.Generator().manual_seed(4)
    draw(w, c)
    d = torch.Generator().manual_seed(4)
    torch.rand(1, generator=d, dtype=torch.float64)
    assert torch.equal(c.get_state(), d.get_state())


@pytest.mark.parametrize("bad", [torch.zeros(4), torch.tensor([1.0, float("nan")]), torch.tensor([float("inf"), 1.0])])
def test_draw_refuses_weights_without_a_positive_finite_sum(bad):
    with pytest.raises(ValueError, match="weights"):
        draw(bad, torch.Generator().manual_seed(0))


def test_untempered_logprobs_are_the_full_softmax_and_sampling_matches_them():
    x = torch.randn(1000)
    full, logp = sampling_logprobs(x, SamplingParams(temperature=1.0))
    assert torch.equal(full, logp)
    tok, lp, slp = sample(x, SamplingParams(temperature=1.0), sample_generator(1, 0))
    assert lp == slp == float(full[tok])
    _, trunc = sampling_logprobs(x, SamplingParams(temperature=1.0, top_k=10))
    assert int(torch.isfinite(trunc).sum()) == 10
