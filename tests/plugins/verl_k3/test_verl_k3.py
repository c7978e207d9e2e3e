"""verl 0.9.1 plugin: entry-point discovery, registry, parity with verl's own GSPO, masking, metrics.

Runs in the verl environment (`make test-verl`, .venv-verl); skipped where verl is not installed.
"""
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch

pytest.importorskip("verl.trainer.ppo.core_algos")

from verl import DataProto  # noqa: E402
from verl.trainer.ppo.core_algos import compute_policy_loss_gspo, get_policy_loss_fn  # noqa: E402
from verl.workers.config.actor import ActorConfig, PolicyLossConfig  # noqa: E402

import k3.rl  # noqa: E402
import k3_verl  # noqa: E402

AGG_MODES = ["seq-mean-token-mean", "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def _config(agg: str, mode: str = "k3_gspo", low: float = 3e-4, high: float = 4e-4) -> ActorConfig:
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio_low=low,
        clip_ratio_high=high,
        loss_agg_mode=agg,
        policy_loss=PolicyLossConfig(loss_mode=mode),
    )


def _inputs(seed: int, b: int = 8, t: int = 16):
    """Random verl-style inputs: token advantages, 0/1 float mask (>= 1 token per row), ratios on both sides of
    the clip band, one row (0) whose log ratio exceeds verl's clamp (10)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 4
    log_prob = old + torch.randn(b, t, generator=g) * 1e-3
    log_prob[0] = old[0] + 12.0
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).float()
    adv = torch.randn(b, generator=g)[:, None].expand(b, t) + 0.1 * torch.randn(b, t, generator=g)
    adv[0] = adv[0].abs() + 0.1  # positive advantage above the band: row 0 is clipped
    is_w = torch.rand(b, t, generator=g) * 2
    return old, log_prob, adv.contiguous(), mask, is_w


def _run(fn, old, log_prob, adv, mask, agg, config, is_w):
    x = log_prob.clone().requires_grad_()
    loss, metrics = fn(old, x, adv, mask, agg, config, is_w)
    loss.backward()
    return loss.detach(), x.grad, metrics


def test_entry_point_registers_loss_on_import_verl():
    """The installed distribution declares the `verl.plugins` entry point, and a fresh `import verl` (which loads
    the group's entry points) registers k3_gspo without importing k3_verl ourselves."""
    eps = {ep.name: ep.value for ep in entry_points(group="verl.plugins")}
    assert eps.get("k3") == "k3_verl"
    code = (
        "import verl\n"
        "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R\n"
        "print(R['k3_gspo'].__module__ if 'k3_gspo' in R else 'absent')\n"
    )
    env = dict(os.environ, VERL_USE_EXTERNAL_PLUGINS="auto")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "k3_verl.loss"


def test_registry_returns_our_loss():
    assert get_policy_loss_fn("k3_gspo") is k3_verl.compute_policy_loss_k3_gspo
    assert get_policy_loss_fn("gspo") is compute_policy_loss_gspo  # we do not override verl's own


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("with_is_weights", [False, True])
@pytest.mark.parametrize("global_info", [False, True])
def test_masking_off_equals_verl_gspo(monkeypatch, agg, with_is_weights, global_info):
    """With masking off, k3_gspo == verl's compute_policy_loss_gspo: loss, gradient, clip fraction, ppo_kl."""
    monkeypatch.setenv("K3_GSPO_MASK", "off")
    old, log_prob, adv, mask, is_w = _inputs(seed=len(agg) + 2 * with_is_weights + global_info)
    is_w = is_w if with_is_weights else None
    results = []
    for fn in (compute_policy_loss_gspo, get_policy_loss_fn("k3_gspo")):
        config = _config(agg)
        if global_info:  # as verl's ppo_loss fills it under data parallelism (here: a 2-rank global batch)
            config.global_batch_info.update(
                dp_size=2, batch_num_tokens=mask.sum() * 2, global_batch_size=mask.shape[0] * 2, loss_scale_factor=32
            )
        results.append(_run(fn, old, log_prob, adv, mask, agg, config, is_w))
    (l_v, g_v, m_v), (l_k, g_k, m_k) = results
    torch.testing.assert_close(l_k, l_v, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g_k, g_v, rtol=1e-6, atol=1e-9)
    assert g_v[0].abs().max() == 0  # the row past the clamp gets no gradient in either
    assert g_v.abs().sum() > 0
    assert m_k["actor/pg_clipfrac"] == pytest.approx(m_v["actor/pg_clipfrac"], abs=1e-6)
    assert 0 < m_v["actor/pg_clipfrac"] < 1
    assert m_k["actor/ppo_kl"] == pytest.approx(m_v["actor/ppo_kl"], rel=1e-5)
    assert m_k["actor/pg_clipfrac_lower"] == 0.0
    assert m_k["actor/k3_masked_frac"] == 0.0


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean"])
def test_masking_on_equals_verl_gspo_on_kept_tokens(monkeypatch, agg):
    """Masking on: tokens whose pi_theta/pi_old ratio leaves the band get no gradient and leave the (local)
    denominators, i.e. the loss is verl's gspo on the kept tokens."""
    monkeypatch.setenv("K3_GSPO_MASK", "0.5_2.0")
    old, log_prob, adv, mask, _ = _inputs(seed=7)
    log_prob[1, 0] = old[1, 0] + 1.0  # ratio e > 2
    log_prob[2, 0] = old[2, 0] - 1.0  # ratio 1/e < 0.5
    keep = mask.bool() & ((log_prob - old).abs() < 0.7)
    assert keep.sum() < mask.sum()
    l_k, g_k, m_k = _run(get_policy_loss_fn("k3_gspo"), old, log_prob, adv, mask, agg, _config(agg), None)
    l_v, g_v, _ = _run(compute_policy_loss_gspo, old, log_prob, adv, keep.float(), agg, _config(agg), None)
    torch.testing.assert_close(l_k, l_v, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g_k, g_v, rtol=1e-6, atol=1e-9)
    assert bool((g_k[~keep] == 0).all())
    n = mask.sum().item()
    assert m_k["actor/k3_masked_frac"] == pytest.approx((n - keep.sum().item()) / n)


def test_sequence_masking(monkeypatch):
    monkeypatch.setenv("K3_GSPO_MASK", "0.5_2.0")
    monkeypatch.setenv("K3_GSPO_SEQ_MASK", "1")
    old, log_prob, adv, mask, _ = _inputs(seed=3)
    agg = "seq-mean-token-mean"
    _, grad, m = _run(get_policy_loss_fn("k3_gspo"), old, log_prob, adv, mask, agg, _config(agg), None)
    # row 0 (log ratio 12 everywhere) is rejected whole; the others stay
    assert m["actor/k3_seq_masked_frac"] == pytest.approx(1 / 8)
    assert grad[0].abs().max() == 0 and grad[1:].abs().sum() > 0


def test_bad_input_and_settings(monkeypatch):
    old, log_prob, adv, mask, _ = _inputs(seed=1)
    fn = get_policy_loss_fn("k3_gspo")
    bad = log_prob.clone()
    bad[3, 0] = float("nan")
    with pytest.raises(ValueError, match="logp has 1 NaN/inf"):
        fn(old, bad, adv, mask, "token-mean", _config("token-mean"), None)
    with pytest.raises(ValueError, match="old_logp shape"):
        fn(old[:, :-1], log_prob, adv, mask, "token-mean", _config("token-mean"), None)
    with pytest.raises(ValueError, match="agg must be one of"):
        fn(old, log_prob, adv, mask, "mean", _config("token-mean"), None)
    monkeypatch.setenv("K3_GSPO_MASK", "half")
    with pytest.raises(ValueError, match="K3_GSPO_MASK"):
        fn(old, log_prob, adv, mask, "token-mean", _config("token-mean"), None)


def test_mismatch_metrics_added_to_verl_debug_metrics(monkeypatch):
    monkeypatch.setenv("K3_GSPO_MASK", "0.5_2.0")
    import verl.utils.debug.metrics as dm

    g = torch.Generator().manual_seed(0)
    b, t = 4, 6
    old = -torch.rand(b, t, generator=g) * 3
    rollout = old + torch.randn(b, t, generator=g) * 0.05
    rollout[0, 0] = old[0, 0] - 1.0
    mask = torch.ones(b, t)
    mask[2, 4:] = 0
    data = DataProto.from_dict(
        tensors={
            "old_log_probs": old,
            "rollout_log_probs": rollout,
            "response_mask": mask,
            "responses": torch.zeros(b, t, dtype=torch.long),
        }
    )
    out = dm.calculate_debug_metrics(data)
    assert "training/rollout_probs_diff_max" in out  # verl's own keys unchanged
    ref = k3.rl.mismatch_metrics(old, rollout, mask, band=(0.5, 2.0))
    for k, v in ref.items():
        assert out[f"training/k3_mismatch/{k}"] == pytest.approx(v)
    assert out["training/k3_mismatch/max_abs_dlogp"] == pytest.approx(1.0, rel=1e-6)
    assert out["training/k3_mismatch/masked_frac"] == pytest.approx(1 / 22)
    k3_verl.install_mismatch_metrics()  # idempotent: no double wrapping
    assert not getattr(dm.calculate_debug_metrics.__wrapped__, "_k3_wrapped", False)


def test_kl_metrics_match_verl_kl_penalty():
    from verl.trainer.ppo.core_algos import kl_penalty

    g = torch.Generator().manual_seed(5)
    lp = -torch.rand(3, 5, generator=g) * 2
    ref = lp + torch.randn(3, 5, generator=g) * 0.1
    mask = torch.ones(3, 5, dtype=torch.bool)
    ours = k3_verl.kl_metrics(lp, ref, mask)
    for kind in ("k1", "k2", "k3"):
        assert ours[kind] == pytest.approx(kl_penalty(lp, ref, kind).mean().item(), rel=1e-5)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_through_verl_ppo_loss(monkeypatch, agg):
    """verl's actor loss (`workers/utils/losses.py::ppo_loss`, the engine path) picks k3_gspo from
    `actor.policy_loss.loss_mode`; with masking off its loss and gradient equal the run with loss_mode=gspo."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    monkeypatch.setenv("K3_GSPO_MASK", "off")
    b, p, r = 3, 2, 5
    lens = torch.tensor([5, 2, 4])
    rmask = torch.arange(r)[None] < lens[:, None]
    old, log_prob, adv, _, _ = _inputs(seed=11, b=b, t=r)
    out = {}
    for mode in ("gspo", "k3_gspo"):
        x = log_prob.clone().requires_grad_()
        # unpadded model output: per sequence, prompt + response positions; response log-probs sit one to the left
        flat = torch.cat([torch.cat([torch.zeros(p - 1), x[i, : lens[i]], torch.zeros(1)]) for i in range(b)])
        data = TensorDict(
            {
                "prompts": torch.ones(b, p, dtype=torch.long),
                "responses": torch.ones(b, r, dtype=torch.long),
                "attention_mask": torch.cat([torch.ones(b, p, dtype=torch.long), rmask.long()], 1),
                "response_mask": rmask.long(),
                "old_log_probs": old,
                "advantages": adv,
            },
            batch_size=[b],
        )
        tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(rmask.sum()), global_batch_size=b)
        loss, metrics = ppo_loss(_config(agg, mode), {"log_probs": flat}, data)
        loss.backward()
        out[mode] = (loss.detach(), x.grad, set(metrics))
    torch.testing.assert_close(out["k3_gspo"][0], out["gspo"][0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out["k3_gspo"][1], out["gspo"][1], rtol=1e-6, atol=1e-9)
    assert out["gspo"][1].abs().sum() > 0
    assert {"actor/pg_loss", "actor/pg_clipfrac", "actor/k3_masked_frac"} <= out["k3_gspo"][2]
