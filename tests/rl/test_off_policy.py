"""Off-policy corrections: importance weights with IcePop/MIS masking, mismatch metrics, staleness."""
import math

import pytest
import torch

from k3.rl import filter_stale, gspo_loss, importance_weights, mismatch_metrics

LN = math.log


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 5, generator=g, dtype=torch.float64) * 3
    lp = (old + torch.randn(4, 5, generator=g, dtype=torch.float64) * 1e-3).requires_grad_()
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[1, 3:] = False
    adv = torch.tensor([1.0, -0.5, 2.0, -1.0], dtype=torch.float64)
    return lp, old, adv, mask


def test_importance_weights_by_hand():
    trainer = torch.zeros(2, 3)
    # ratios pi_old/mu: row 0: 1, 3 (out), 0.4 (out); row 1: 1.5, 0.8, pad
    rollout = torch.tensor([[0.0, -LN(3.0), -LN(0.4)], [-LN(1.5), -LN(0.8), 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    iw = importance_weights(trainer, rollout, mask, band=(0.5, 2.0))
    assert iw.keep.tolist() == [[True, False, False], [True, True, False]]
    torch.testing.assert_close(iw.weights, torch.tensor([[1.0, 0.0, 0.0], [1.5, 0.8, 0.0]]))
    assert iw.metrics["masked_frac"] == pytest.approx(2 / 5)
    assert iw.metrics["seq_masked_frac"] == 0.0
    assert iw.metrics["is_weight_mean"] == pytest.approx((1 + 1.5 + 0.8) / 3)
    # sequence weights: geometric mean of the kept tokens' ratios
    seq = importance_weights(trainer, rollout, mask, band=(0.5, 2.0), level="sequence")
    torch.testing.assert_close(seq.weights[1, :2], torch.full((2,), math.sqrt(1.5 * 0.8)))
    # sequence masking (Geo-MIS): row 0's geometric mean ratio (1*3*0.4)^(1/3) ~ 1.06 is inside, so only
    # its tokens go; a wide band with a row whose geometric mean is outside drops the whole row
    sm = importance_weights(trainer, rollout, mask, band=(0.9, 1.1), seq_mask=True)
    assert sm.keep.tolist() == [[True, False, False], [False, False, False]]
    assert sm.metrics["seq_masked_frac"] == 0.5
    none = importance_weights(trainer, rollout, mask, band=None, level=None)
    assert torch.equal(none.keep, mask) and torch.equal(none.weights, mask.float())


def test_masked_tokens_get_no_gradient_and_leave_denominator():
    lp, old, adv, mask = _batch()
    rollout = old.clone()
    rollout[0, 1] += 2.0  # ratio e^-2 < 0.5: masked
    rollout[2, 4] -= 1.0  # ratio e^1 > 2: masked
    loss, m = gspo_loss(lp, old, adv, mask, rollout_logp=rollout, is_level=None)
    loss.backward()
    keep = mask.clone()
    keep[0, 1] = keep[2, 4] = False
    x = lp.detach().clone().requires_grad_()
    ref, _ = gspo_loss(x, old, adv, keep)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    torch.testing.assert_close(lp.grad, x.grad)
    assert lp.grad[0, 1] == 0 and lp.grad[2, 4] == 0
    assert m["masked_frac"] == pytest.approx(2 / 18)
    assert m["mismatch/max_abs_dlogp"] == pytest.approx(2.0)
    # with token weights: equals the plain loss on the kept tokens weighted by pi_old/mu
    w = torch.where(keep, (old - rollout).exp(), torch.zeros_like(old))
    lw, mw = gspo_loss(lp, old, adv, mask, rollout_logp=rollout, is_level="token")
    rw, _ = gspo_loss(lp, old, adv, keep, token_weights=w)
    assert lw.item() == pytest.approx(rw.item(), rel=1e-12)
    assert mw["is_weight_mean"] == pytest.approx(1.0)


def test_rollout_equal_to_old_changes_nothing():
    lp, old, adv, mask = _batch()
    plain, _ = gspo_loss(lp, old, adv, mask)
    loss, m = gspo_loss(lp, old, adv, mask, rollout_logp=old.clone())
    assert loss.item() == plain.item()
    assert m["masked_frac"] == 0.0
    assert m["mismatch/k3_kl"] == 0.0 and m["mismatch/max_abs_dlogp"] == 0.0


def test_policy_band_masks_pi_theta_over_pi_old():
    lp, old, adv, mask = _batch()
    x = lp.detach().clone()
    x[3, 0] = old[3, 0] + 1.0  # pi_theta/pi_old = e > 2
    x.requires_grad_()
    loss, m = gspo_loss(x, old, adv, mask, policy_band=(0.5, 2.0))
    keep = mask.clone()
    keep[3, 0] = False
    ref, _ = gspo_loss(x, old, adv, keep)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    assert m["masked_frac"] == pytest.approx(1 / 18)
    loss.backward()
    assert x.grad[3, 0] == 0


def test_seq_weights_drop_and_weigh_sequences():
    lp, old, adv, mask = _batch()
    st = filter_stale([7, 5, 8, 2], learner_version=8, max_staleness=3, decay=0.5)
    assert st.keep.tolist() == [True, True, True, False]
    assert st.weights.tolist() == [0.5, 0.125, 1.0, 0.0]
    assert st.reasons[3] == "policy version 2 is 6 versions behind learner version 8 (max 3)"
    assert st.rejected_frac == 0.25
    loss, m = gspo_loss(lp, old, adv, mask, seq_weights=st.weights)
    # the rejected row leaves the denominator: seq-mean over 3 sequences, each weighted
    per_seq = [gspo_loss(lp[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1])[0].item() for i in range(3)]
    expected = (0.5 * per_seq[0] + 0.125 * per_seq[1] + 1.0 * per_seq[2]) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="seq_weights shape"):
        gspo_loss(lp, old, adv, mask, seq_weights=torch.ones(3))
    with pytest.raises(ValueError, match="seq_weights must be finite"):
        gspo_loss(lp, old, adv, mask, seq_weights=torch.tensor([1.0, -1.0, 1.0, 1.0]))


def test_everything_masked_gives_zero_loss_not_nan():
    lp, old, adv, mask = _batch()
    loss, m = gspo_loss(lp, old, adv, mask, rollout_logp=old + 5.0)
    loss.backward()
    assert loss.item() == 0.0 and m["masked_frac"] == 1.0 and m["seq_masked_frac"] == 1.0
    assert bool((lp.grad == 0).all())
    assert all(math.isfinite(v) for v in m.values())


def test_filter_stale_ahead_and_errors():
    st = filter_stale(torch.tensor([3, 4]), learner_version=3, max_staleness=0)
    assert st.keep.tolist() == [True, False]
    assert st.reasons == [None, "policy version 4 is ahead of learner version 3"]
    with pytest.raises(ValueError, match="integers"):
        filter_stale([1.5], 2, 1)
    with pytest.raises(ValueError, match="max_staleness"):
        filter_stale([1], 2, -1)
    with pytest.raises(ValueError, match="decay"):
        filter_stale([1], 2, 1, decay=0.0)
    with pytest.raises(ValueError, match="non-empty 1-D"):
        filter_stale([], 2, 1)


def test_mismatch_metrics_by_hand():
    trainer = torch.tensor([[-1.0, -2.0, 0.0]])
    rollout = torch.tensor([[-1.1, -1.8, float("nan")]])
    mask = torch.tensor([[1, 1, 0]])
    m = mismatch_metrics(trainer, rollout, mask, band=(0.9, 1.2))
    d = torch.tensor([0.1, -0.2])  # trainer - rollout = log r
    k3 = (d.exp() - 1 - d).mean().item()
    assert m["k3_kl"] == pytest.approx(k3, rel=1e-5)
    assert m["max_abs_dlogp"] == pytest.approx(0.2, rel=1e-6)
    assert m["mean_abs_dlogp"] == pytest.approx(0.15, rel=1e-6)
    assert m["masked_frac"] == 0.5  # e^-0.2 < 0.9 is masked; e^0.1 < 1.2 is kept


def test_off_policy_errors_name_tensor():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="rollout_logp shape"):
        importance_weights(x, torch.zeros(2, 2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="response_mask shape"):
        importance_weights(x, x, torch.ones(3, 3))
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="^rollout_logp has 1 NaN/inf"):
        importance_weights(x, bad, torch.ones(2, 3))
    with pytest.raises(ValueError, match="band must satisfy"):
        importance_weights(x, x, torch.ones(2, 3), band=(2.0, 3.0))
    with pytest.raises(ValueError, match="level"):
        importance_weights(x, x, torch.ones(2, 3), level="batch")
    with pytest.raises(ValueError, match="no tokens"):
        mismatch_metrics(x, x, torch.zeros(2, 3))
    lp, old, adv, mask = _batch()
    with pytest.raises(ValueError, match="^rollout_logp has"):
        gspo_loss(lp, old, adv, mask, rollout_logp=torch.where(mask, torch.nan, old))
    with pytest.raises(ValueError, match="is_band must satisfy"):
        gspo_loss(lp, old, adv, mask, rollout_logp=old, is_band=(0.5, 0.9))
