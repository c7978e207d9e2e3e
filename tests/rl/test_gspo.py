"""GSPO loss: hand-checked values and gradients, GSPO-token equivalence, aggregation, masks, bad input."""
import math

import pytest
import torch

from k3.rl import aggregate, group_advantages, gspo_loss


def _rand(b=3, t=6, seed=0, dtype=torch.float64, spread=0.01):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=dtype) * 3
    lp = (old + torch.randn(b, t, generator=g, dtype=dtype) * spread).requires_grad_()
    mask = torch.ones(b, t, dtype=torch.bool)
    for i in range(b):
        mask[i, t - i % (t - 1) :] = False  # lengths t, t-1, ..., 2, t, ...
    adv = torch.randn(b, generator=g, dtype=dtype)
    return lp, old, adv, mask


def test_hand_checked_value_and_gradient():
    old = torch.zeros(2, 3, dtype=torch.float64)
    # seq 0: log ratios 0.1, 0.3 (mean 0.2) -> s = e^0.2 > 1 + eps_high, A = +1: clipped, no gradient
    # seq 1: log ratios -1e-4 x3 -> s = e^-1e-4 inside the band, A = -2: loss -A s
    lp = torch.tensor([[0.1, 0.3, 0.0], [-1e-4, -1e-4, -1e-4]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    loss, m = gspo_loss(lp, old, adv, mask)
    s1 = math.exp(-1e-4)
    expected = (-(1 + 4e-4) + 2 * s1) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    g = torch.zeros(2, 3, dtype=torch.float64)
    g[1] = 2 * s1 / 3 / 2  # d/dlogp_t (-A s_1) / B = -A s_1 (1/|y|) / B
    torch.testing.assert_close(lp.grad, g)
    assert m["clip_frac"] == pytest.approx(2 / 5)
    assert m["seq_ratio_max"] == pytest.approx(math.exp(0.2))
    assert m["masked_frac"] == 0.0
    assert m["num_tokens"] == 5.0


def test_unclipped_gradient_is_sequence_mean_of_token_gradients():
    lp, old, adv, mask = _rand()
    loss, _ = gspo_loss(lp, old, adv, mask, eps_low=0.99, eps_high=100.0)
    loss.backward()
    n = mask.sum(-1, keepdim=True)
    s = ((lp.detach() - old) * mask).sum(-1, keepdim=True).div(n).exp()
    expected = torch.where(mask, -adv[:, None] * s / n / lp.shape[0], torch.zeros_like(s))
    torch.testing.assert_close(lp.grad, expected)


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"])
def test_gspo_token_equals_gspo_with_sequence_advantages(agg):
    lp, old, adv, mask = _rand(b=8, seed=1, spread=2e-3)
    outs = []
    for kw in ({}, {"token_level": True}, {"token_level": True, "adv2d": True}):
        x = lp.detach().clone().requires_grad_()
        a = adv[:, None].expand_as(x).clone() if kw.pop("adv2d", False) else adv
        loss, m = gspo_loss(x, old, a, mask, agg=agg, **kw)
        loss.backward()
        outs.append((loss.detach(), x.grad, m["clip_frac"]))
    for loss, grad, cf in outs[1:]:
        torch.testing.assert_close(loss, outs[0][0])
        torch.testing.assert_close(grad, outs[0][1])
        assert cf == outs[0][2]
    assert 0.0 < outs[0][2] < 1.0  # the case exercises both clipped and unclipped sequences


def test_sequences_weigh_equally_in_seq_mean_token_mean():
    # identical per-token log ratios, very different lengths: each sequence contributes -A s / B
    old = torch.zeros(2, 8, dtype=torch.float64)
    lp = torch.full((2, 8), 1e-4, dtype=torch.float64)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, :1] = True
    mask[1, :] = True
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    loss, _ = gspo_loss(lp, old, adv, mask)
    assert loss.item() == pytest.approx(-math.exp(1e-4), rel=1e-12)
    # token-mean weights sequences by length: same here (equal ratio), but per-token A makes it differ
    a2 = torch.tensor([[1.0] * 8, [0.0] * 8], dtype=torch.float64)
    l_seq, _ = gspo_loss(lp, old, a2, mask, token_level=True)
    l_tok, _ = gspo_loss(lp, old, a2, mask, token_level=True, agg="token-mean")
    assert l_seq.item() == pytest.approx(-math.exp(1e-4) / 2, rel=1e-12)
    assert l_tok.item() == pytest.approx(-math.exp(1e-4) / 9, rel=1e-12)


def test_aggregate_modes_by_hand():
    lm = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    assert aggregate(lm, mask, "token-mean").item() == pytest.approx(18 / 5)
    assert aggregate(lm, mask, "token-sum").item() == pytest.approx(18)
    assert aggregate(lm, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 5) / 2)
    assert aggregate(lm, mask, "seq-mean-token-sum").item() == pytest.approx((3 + 15) / 2)
    assert aggregate(lm, mask, "seq-mean-token-sum-norm").item() == pytest.approx((3 + 15) / 2 / 3)
    # global normalisers (data parallel): used as given, times the scale
    assert aggregate(lm, mask, "token-mean", num_tokens=10, scale=2).item() == pytest.approx(18 / 10 * 2)
    assert aggregate(lm, mask, "seq-mean-token-mean", num_seqs=4).item() == pytest.approx(6.5 / 4)
    assert aggregate(lm, torch.zeros_like(mask), "seq-mean-token-mean").item() == 0.0
    with pytest.raises(ValueError, match="agg mode"):
        aggregate(lm, mask, "seq-sum")


def test_padding_is_ignored_and_gets_no_gradient():
    lp, old, adv, mask = _rand()
    loss_a, _ = gspo_loss(lp, old, adv, mask)
    loss_a.backward()
    lp2 = lp.detach().clone()
    old2 = old.clone()
    lp2[~mask] = float("-inf")
    old2[~mask] = float("nan")
    lp2.requires_grad_()
    loss_b, m = gspo_loss(lp2, old2, adv, mask)
    loss_b.backward()
    assert loss_b.item() == loss_a.item()
    assert bool(torch.isfinite(lp2.grad).all())
    assert bool((lp2.grad[~mask] == 0).all())
    torch.testing.assert_close(lp2.grad, lp.grad)
    assert all(math.isfinite(v) for v in m.values())


def test_large_ratio_is_clamped_not_nan():
    old = torch.full((1, 2), -60.0)
    lp = torch.zeros(1, 2, requires_grad=True)
    loss, m = gspo_loss(lp, old, torch.tensor([-1.0]), torch.ones(1, 2))
    loss.backward()
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(math.exp(10.0), rel=1e-5)
    assert bool(torch.isfinite(lp.grad).all())


def test_kl_penalty_added():
    lp, old, adv, mask = _rand()
    ref = old - 0.05
    base, _ = gspo_loss(lp, old, adv, mask)
    loss, m = gspo_loss(lp, old, adv, mask, ref_logp=ref, kl_coef=0.1, kl_kind="k2")
    assert m["kl_loss"] > 0 and m["kl_ref"] > 0
    assert loss.item() == pytest.approx(base.item() + 0.1 * m["kl_loss"], rel=1e-12)
    with pytest.raises(ValueError, match="ref_logp is None"):
        gspo_loss(lp, old, adv, mask, kl_coef=0.1)


def test_bf16_inputs_are_upcast():
    lp, old, adv, mask = _rand(dtype=torch.float32)
    ref, _ = gspo_loss(lp.detach().bfloat16().float(), old.bfloat16().float(), adv, mask)
    loss, _ = gspo_loss(lp.detach().bfloat16(), old.bfloat16(), adv, mask)
    assert loss.dtype == torch.float32
    assert loss.item() == ref.item()


def test_bad_input_errors_name_the_tensor():
    lp, old, adv, mask = _rand()
    with pytest.raises(ValueError, match="old_logp shape"):
        gspo_loss(lp, old[:, :-1], adv, mask)
    with pytest.raises(ValueError, match="response_mask shape"):
        gspo_loss(lp, old, adv, mask[:2])
    with pytest.raises(ValueError, match="advantages shape"):
        gspo_loss(lp, old, adv[:2], mask)
    with pytest.raises(ValueError, match="token_level=True"):
        gspo_loss(lp, old, adv[:, None].expand_as(old), mask)
    with pytest.raises(ValueError, match="rollout_logp shape"):
        gspo_loss(lp, old, adv, mask, rollout_logp=old[:1])
    with pytest.raises(ValueError, match="logp must be \\[B, T\\]"):
        gspo_loss(lp[0], old, adv, mask)
    with pytest.raises(ValueError, match="logp is empty"):
        gspo_loss(lp[:, :0], old[:, :0], adv, mask[:, :0])
    for name, idx in (("logp", 0), ("old_logp", 1)):
        args = [lp.detach().clone(), old.clone()]
        args[idx][1, 0] = float("inf")
        with pytest.raises(ValueError, match=f"^{name} has 1 NaN/inf"):
            gspo_loss(args[0], args[1], adv, mask)
    with pytest.raises(ValueError, match="advantages has NaN"):
        gspo_loss(lp, old, torch.tensor([0.0, float("nan"), 1.0], dtype=adv.dtype), mask)
    empty = mask.clone()
    empty[1] = False
    with pytest.raises(ValueError, match=r"response_mask has empty responses .*\[1\]"):
        gspo_loss(lp, old, adv, empty)
    # allow_empty: the empty row is skipped (same as dropping it)
    loss, _ = gspo_loss(lp, old, adv, empty, allow_empty=True)
    keep = torch.tensor([0, 2])
    ref, _ = gspo_loss(lp[keep], old[keep], adv[keep], mask[keep])
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    with pytest.raises(ValueError, match="eps_low"):
        gspo_loss(lp, old, adv, mask, eps_low=1.5)
    with pytest.raises(ValueError, match="agg must be"):
        gspo_loss(lp, old, adv, mask, agg="mean")


def test_group_advantages_by_hand():
    a = group_advantages([1.0, 0.0, 1.0, 1.0, 0.0, 0.0], group_size=3)
    c = 1 / 3 / math.sqrt(1 / 3)
    torch.testing.assert_close(a, torch.tensor([c, -2 * c, c, 2 * c, -c, -c]), atol=1e-5, rtol=1e-5)
    b = group_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0]), group_ids=["p", "q", "p", "q", "p", "q"])
    torch.testing.assert_close(b, a[[0, 3, 1, 4, 2, 5]])
    # a group of equal rewards or of one response has advantage 0; no NaN
    z = group_advantages([2.0, 2.0, 5.0], group_ids=[0, 0, 1])
    assert z.tolist() == [0.0, 0.0, 0.0]
    centred = group_advantages([1.0, 3.0], group_size=2, scale_by_std=False)
    assert centred.tolist() == [-1.0, 1.0]


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="exactly one"):
        group_advantages([1.0, 2.0])
    with pytest.raises(ValueError, match="does not divide"):
        group_advantages([1.0, 2.0, 3.0], group_size=2)
    with pytest.raises(ValueError, match="group_ids has 1 entries"):
        group_advantages([1.0, 2.0], group_ids=[0])
    with pytest.raises(ValueError, match=r"rewards has NaN/inf values at indices \[1\]"):
        group_advantages([1.0, float("nan")], group_size=2)
