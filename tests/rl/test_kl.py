"""KL estimators k1/k2/k3: hand values, unbiasedness on exact distributions, gradients, masks, errors."""
import math

import pytest
import torch

from k3.rl import kl_estimate, kl_per_token


def test_hand_values():
    # pi(x) = 0.5, ref(x) = 0.25 -> r = 0.5
    lp = torch.full((1, 1), math.log(0.5))
    ref = torch.full((1, 1), math.log(0.25))
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(math.log(2), rel=1e-6)
    assert kl_estimate(lp, ref, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2, rel=1e-6)
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(0.5 - 1 + math.log(2), rel=1e-6)


def test_mean_over_mask_only():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, float("-inf")]])
    ref = torch.tensor([[-1.5, -2.0, float("nan")], [-0.25, -0.75, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    log_r = torch.tensor([-0.5, 0.0, 0.25, -0.25])  # ref - logp at the 4 masked tokens
    assert kl_estimate(lp, ref, "k1", mask).item() == pytest.approx(float((-log_r).mean()), abs=1e-7)
    assert kl_estimate(lp, ref, "k2", mask).item() == pytest.approx(float((0.5 * log_r**2).mean()), abs=1e-7)
    k3 = (log_r.exp() - 1 - log_r).mean()
    assert kl_estimate(lp, ref, "k3", mask).item() == pytest.approx(float(k3), abs=1e-7)


def test_k1_k3_unbiased_exactly_under_pi():
    """E_{x~pi}[k1] = E_{x~pi}[k3] = KL(pi || ref): weight each vocab entry by pi(x) instead of sampling."""
    torch.manual_seed(0)
    logits_pi, logits_ref = torch.randn(50, dtype=torch.float64), torch.randn(50, dtype=torch.float64)
    lp, ref = logits_pi.log_softmax(-1), logits_ref.log_softmax(-1)
    kl = float((lp.exp() * (lp - ref)).sum())
    p = lp.exp()[None]
    for kind in ("k1", "k3"):
        e = float((kl_per_token(lp[None], ref[None], kind) * p).sum())
        assert e == pytest.approx(kl, rel=1e-10)
    # k2 is biased but close for close distributions, and >= 0 per token like k3
    assert bool((kl_per_token(lp[None], ref[None], "k2") >= 0).all())
    assert bool((kl_per_token(lp[None], ref[None], "k3") >= 0).all())


def test_gradients():
    torch.manual_seed(1)
    lp = (torch.randn(2, 4, dtype=torch.float64) - 1).requires_grad_()
    ref = torch.randn(2, 4, dtype=torch.float64) - 1
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    n = 6
    r = (ref - lp.detach()).exp()
    expected = {
        "k1": torch.ones_like(r) / n,
        "k2": (lp.detach() - ref) / n,
        "k3": (1 - r) / n,
    }
    for kind, g in expected.items():
        lp.grad = None
        kl_estimate(lp, ref, kind, mask).backward()
        torch.testing.assert_close(lp.grad, torch.where(mask, g, torch.zeros_like(g)))
    assert torch.autograd.gradcheck(lambda x: kl_estimate(x, ref, "k3", mask), (lp,))


def test_k3_precise_for_tiny_mismatch():
    # 1e-4 log-prob gap: k3 ~ (1e-4)^2 / 2 = 5e-9; expm1 keeps it accurate in fp32
    lp = torch.zeros(1, 1)
    ref = torch.full((1, 1), 1e-4)
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(5.0e-9 * (1 + 1e-4 / 3), rel=1e-3)


def test_errors_name_tensor():
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="ref_logp shape"):
        kl_estimate(lp, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="mask shape"):
        kl_estimate(lp, lp, mask=torch.ones(3, 2))
    with pytest.raises(ValueError, match="kind"):
        kl_estimate(lp, lp, "k4")
    with pytest.raises(ValueError, match="no tokens"):
        kl_estimate(lp, lp, mask=torch.zeros(2, 3))
    bad = lp.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"logp has 1 NaN/inf .*\(1, 2\)"):
        kl_estimate(bad, lp)
    with pytest.raises(ValueError, match="ref_logp has 1 NaN/inf"):
        kl_estimate(lp, bad)
    with pytest.raises(ValueError, match="mask must hold only 0/1"):
        kl_estimate(lp, lp, mask=torch.full((2, 3), 0.5))
