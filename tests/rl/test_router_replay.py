"""Router Replay (R3): replaying the rollout's experts lowers the train/rollout mismatch when the trainer's weights
differ slightly from the rollout's (here: 1e-3 / 3e-3 relative perturbations of the tiny MoE, which flip experts).
Run with -s to see the measured table."""

import pytest
import torch

from benchmarks.router_replay import PROMPT, T, perturbed, rollout_batch
from k3.config import K3Config
from k3.rl import Batch, Learner, LearnerConfig, check_routed_experts, mismatch_metrics, routing_diff



@pytest.fixture
def rollout():
    """The "rollout engine": the unperturbed tiny model scores a batch and records its routing (the same setup
    benchmarks/router_replay.py measures)."""
    return rollout_batch()


def test_unperturbed_replay_is_exact(rollout):
    model, batch = rollout
    learner = Learner(model, LearnerConfig(router_replay=True))
    lp = learner.compute_logprobs(batch)
    m = batch.response_mask
    assert torch.equal(lp[m], batch.rollout_logp[m])


def test_partial_routing_prompt_served_from_cache(rollout):
    """Prompt tokens whose routing the engine did not record (-1) route freely; the rest are replayed."""
    model, batch = rollout
    partial = batch.routed_experts.clone()
    partial[:, :PROMPT] = -1
    trainer = perturbed(model, 3e-3, 2)
    full = Learner(trainer, LearnerConfig()).compute_logprobs(batch)
    part = Learner(trainer, LearnerConfig()).compute_logprobs(Batch(**{**batch.__dict__, "routed_experts": partial}))
    free = Learner(trainer, LearnerConfig(router_replay=False)).compute_logprobs(batch)
    m = batch.response_mask
    k3 = {n: mismatch_metrics(v, batch.rollout_logp, m)["k3_kl"] for n, v in (("full", full), ("part", part),
                                                                              ("free", free))}
    assert k3["full"] <= k3["part"] < k3["free"]


@pytest.mark.parametrize("rel", [1e-3, 3e-3])
def test_r3_lowers_train_rollout_mismatch(rollout, rel):
    model, batch = rollout
    mask = batch.response_mask
    print(f"\nR3 on the tiny MoE (8 experts, top-2, 7 MoE layers), {int(mask.sum())} response tokens; trainer = "
          f"rollout weights + {rel:g} relative Gaussian noise (3 draws)")
    print(f"  {'draw':4s} {'flips':>7s} {'tok flips':>9s} | {'k3 KL no R3':>11s} {'k3 KL R3':>9s} {'ratio':>6s} | "
          f"{'max|dlp| no R3':>14s} {'R3':>7s} | {'mean|dlp| no R3':>15s} {'R3':>8s}")
    for seed in (1, 2, 3):
        trainer = perturbed(model, rel, seed)
        with torch.no_grad():
            own = trainer(batch.tokens[:, :-1], use_cache=False, return_routed_experts=True).routed_experts
        flips = routing_diff(own, batch.routed_experts[:, : T - 1].long(), mask[:, 1:])
        res = {}
        for replay in (False, True):
            learner = Learner(trainer, LearnerConfig(router_replay=replay))
            res[replay] = mismatch_metrics(learner.compute_logprobs(batch), batch.rollout_logp, mask)
            if seed == 1:  # the learner reports the same mismatch (and flips) in its step metrics
                fb = learner.forward_backward(batch)
                assert abs(fb["mismatch_k3_kl"] - res[replay]["k3_kl"]) < 1e-6 * res[replay]["k3_kl"]
                if not replay:
                    assert abs(fb["router_flip_frac"] - flips["flip_frac"]) < 1e-9
        no, r3 = res[False], res[True]
        print(f"  {seed:4d} {flips['flip_frac']:7.4f} {flips['token_flip_frac']:9.4f} | {no['k3_kl']:11.3e} "
              f"{r3['k3_kl']:9.3e} {no['k3_kl'] / r3['k3_kl']:6.1f} | {no['max_abs_dlogp']:14.3e} "
              f"{r3['max_abs_dlogp']:7.3e} | {no['mean_abs_dlogp']:15.3e} {r3['mean_abs_dlogp']:8.3e}")
        assert flips["flip_frac"] > 0  # the perturbation flips experts
        assert r3["k3_kl"] < no["k3_kl"]
        assert r3["max_abs_dlogp"] < no["max_abs_dlogp"]
        assert r3["mean_abs_dlogp"] < no["mean_abs_dlogp"]


def test_check_routed_experts():
    cfg = K3Config.preset("tiny")
    n_moe, k = len(cfg.moe_layer_ids), cfg.num_experts_per_token
    r = torch.zeros(2, 5, n_moe, k, dtype=torch.int16)
    assert check_routed_experts(r, 2, 5, cfg).dtype == torch.int64
    assert check_routed_experts(r[:, :4], 2, 5, cfg).shape[1] == 4  # engines record T - 1 positions
    r[0, :2] = -1  # prompt tokens served from a prefix cache: not recorded
    check_routed_experts(r, 2, 5, cfg)
    half = r.clone()
    half[1, 0, 0, 0] = -1
    with pytest.raises(ValueError, match="all valid or all -1"):
        check_routed_experts(half, 2, 5, cfg)
    cases = ((r.float(), "integer"), (r[0], r"\[B, T, n_moe_layers, top_k\]"), (r[:, :3], "shape"),
             (r[..., :1], "n_moe_layers"), (r - 1, "expert ids must be in"), (r + cfg.num_experts, "expert ids"),
             ([1], "Tensor"))
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            check_routed_experts(bad, 2, 5, cfg)


def test_routing_diff_counts_sets_not_order():
    a = torch.tensor([[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]])  # [1, 2 tokens, 2 layers, k=2]
    b = torch.tensor([[[[1, 0], [2, 3]], [[4, 6], [6, 7]]]])  # token 0: same sets; token 1 layer 0: 5 -> 6
    d = routing_diff(a, b)
    assert d == {"flip_frac": 0.25, "token_flip_frac": 0.5, "expert_flip_frac": 0.125}
    assert routing_diff(a, b, torch.tensor([[True, False]]))["flip_frac"] == 0.0
    b[0, 0] = -1  # token 0 not recorded: only token 1's pairs count
    assert routing_diff(a, b) == {"flip_frac": 0.5, "token_flip_frac": 1.0, "expert_flip_frac": 0.25}
    with pytest.raises(ValueError, match="equal-shaped"):
        routing_diff(a, b[..., :1])
