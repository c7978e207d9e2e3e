"""k3.rl.Learner: GSPO steps on the tiny K3 (LoRA and full parameters), accumulation, KL reference, export,
bad input."""
import math

import pytest
import torch

from k3.config import K3Config
from k3.lora import LoRAAdapter, LoRAConfig
from k3.model import K3ForCausalLM
from k3.rl import Batch, Learner, LearnerConfig

B, T, PROMPT = 4, 12, 4


def _model(seed=0):
    torch.manual_seed(seed)
    return K3ForCausalLM(K3Config.preset("tiny"))


def _batch(model, adv=(1.0, 1.0, -1.0, -1.0)) -> Batch:
    """Right-padded prompt+response rows; rollout log-probs and routing recorded from `model` (on-policy)."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(3, model.config.vocab_size, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[:, PROMPT:] = True
    mask[3, T - 2:] = False  # a shorter response (padding after it)
    with torch.no_grad():
        out = model(tokens[:, :-1], use_cache=False, return_routed_experts=True)
    lg = out.logits.float()
    lp = lg.gather(-1, tokens[:, 1:, None])[..., 0] - lg.logsumexp(-1)
    rollout = torch.cat([torch.zeros(B, 1), lp], 1)
    return Batch(tokens, mask, rollout, torch.tensor(adv), routed_experts=out.routed_experts.to(torch.int16))


def _seq_logp(learner, batch):
    lp = learner.compute_logprobs(batch)
    m = batch.response_mask.float()
    return (lp * m).sum(1) / m.sum(1)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_steps_raise_rewarded_and_lower_punished_sequences(mode):
    model = _model()
    batch = _batch(model)
    cfg = LearnerConfig(lr=1e-2, lora=LoRAConfig.preset("tiny")) if mode == "lora" else LearnerConfig(lr=1e-3)
    learner = Learner(model, cfg, seed=0)
    start = _seq_logp(learner, batch)
    for step in range(3):
        m = learner.forward_backward(batch)
        if step == 0:  # on-policy, same weights as the rollout: no mismatch, nothing masked or clipped
            assert m["mismatch_k3_kl"] == 0.0 and m["max_abs_dlogp"] == 0.0 and m["masked_frac"] == 0.0
            assert m["clip_frac"] == 0.0 and m["num_tokens"] == float(batch.response_mask.sum())
        s = learner.optim_step()
        assert s["grad_norm"] > 0 and math.isfinite(s["grad_norm"]) and s["step"] == step + 1
    end = _seq_logp(learner, batch)
    print(f"\n[{mode}] mean response log-prob per sequence: start {start.tolist()} -> end {end.tolist()}")
    assert (end[:2] > start[:2] + 0.05).all()  # advantage +1
    assert (end[2:] < start[2:] - 0.05).all()  # advantage -1
    assert m["mismatch_k3_kl"] > 0  # the policy moved away from the (fixed) rollout log-probs


def test_loss_falls_on_a_fixed_batch_with_fixed_old_policy():
    model = _model()
    batch = _batch(model)
    learner = Learner(model, LearnerConfig(lr=1e-4, eps_low=0.2, eps_high=0.2, lora=LoRAConfig.preset("tiny")),
                      seed=0)
    batch.old_logp = learner.compute_logprobs(batch)
    losses = []
    for _ in range(4):
        losses.append(learner.forward_backward(batch)["loss"])
        learner.optim_step()
    print(f"\nGSPO loss over steps (fixed pi_old, eps 0.2): {losses}")
    assert all(b < a for a, b in zip(losses, losses[1:]))


def _grads(learner):
    return [p.grad.clone() for p in learner.params]


def test_micro_batches_accumulate_to_the_full_batch_gradient():
    model = _model()
    batch = _batch(model)
    learner = Learner(model, LearnerConfig(lora=LoRAConfig.preset("tiny", init_scale=0.02)), seed=0)
    full = learner.forward_backward(batch)
    g_full = _grads(learner)
    learner.optimizer.zero_grad()
    split = learner.forward_backward(batch, micro_batch_size=3)
    g_split = _grads(learner)
    learner.optimizer.zero_grad()
    n_tok = float(batch.response_mask.sum())
    for rows in (slice(0, 1), slice(1, 4)):  # accumulation over separate calls with the global counts
        learner.forward_backward(batch.select(rows), num_seqs=B, num_tokens=n_tok)
    g_calls = _grads(learner)
    assert split["micro_batches"] == 2.0 and abs(split["loss"] - full["loss"]) < 1e-6
    for a, b, c in zip(g_full, g_split, g_calls):
        scale = a.abs().max()
        assert scale > 0 and (a - b).abs().max() < 1e-5 * scale and (a - c).abs().max() < 1e-5 * scale
    assert learner.optim_step()["grad_norm"] > 0


def test_gspo_token_with_broadcast_advantages_matches_gspo():
    model = _model()
    batch = _batch(model)
    seq = Learner(model, LearnerConfig(lora=LoRAConfig.preset("tiny", init_scale=0.02)), seed=0)
    batch.rollout_logp = seq.compute_logprobs(batch)  # on-policy: importance weights 1 (they weight tokens)
    m_seq = seq.forward_backward(batch)
    g_seq = _grads(seq)
    seq.lora.close()
    tok = Learner(model, LearnerConfig(token_level=True, lora=LoRAConfig.preset("tiny", init_scale=0.02)), seed=0)
    per_token = Batch(**{**batch.__dict__, "advantages": batch.advantages[:, None].expand(B, T).clone()})
    m_tok = tok.forward_backward(per_token)
    assert abs(m_seq["loss"] - m_tok["loss"]) < 1e-7
    for a, b in zip(g_seq, _grads(tok)):
        assert (a - b).abs().max() <= 1e-5 * a.abs().max()  # fp32: the two objectives sum in other orders
    with pytest.raises(ValueError, match="token_level=True"):
        seq.forward_backward(per_token)


def test_lora_kl_reference_is_the_base_model():
    model = _model()
    batch = _batch(model)
    learner = Learner(model, LearnerConfig(lr=1e-2, kl_coef=0.1, lora=LoRAConfig.preset("tiny")), seed=0)
    m0 = learner.forward_backward(batch)
    assert m0["kl_ref"] == 0.0  # B = 0: the adapted policy is the base
    learner.optim_step()
    m1 = learner.forward_backward(batch)
    assert m1["kl_ref"] > 0
    assert abs(m1["loss"] - (m1["pg_loss"] + 0.1 * m1["kl_loss"])) < 1e-6


def test_full_parameter_mode_with_kl_reference_and_router_gradient():
    model = _model()
    batch = _batch(model)
    learner = Learner(model, LearnerConfig(lr=1e-3, kl_coef=0.05), seed=0)
    assert learner.ref_model is not model
    m = learner.forward_backward(batch)
    assert m["kl_ref"] == 0.0
    router = model.model.layers[1].block_sparse_moe.gate.weight
    assert router.grad is not None and router.grad.abs().sum() > 0  # R3 recomputes gate weights with gradient
    before = {k: v.clone() for k, v in learner.policy_state_dict().items()}
    learner.optim_step()
    after = learner.policy_state_dict()
    assert not torch.equal(before["model.layers.3.self_attn.kv_b_proj.weight"],
                           after["model.layers.3.self_attn.kv_b_proj.weight"])
    assert learner.forward_backward(batch)["kl_ref"] > 0
    with pytest.raises(ValueError, match="full parameters"):
        learner.adapter_state_dict()


def test_policy_state_dict_and_adapter_export(tmp_path):
    model = _model()
    batch = _batch(model)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    learner = Learner(model, LearnerConfig(lr=1e-2, lora=LoRAConfig.preset("tiny", targets=("attn", "experts"))),
                      seed=0)
    for _ in range(2):
        learner.forward_backward(batch)
        learner.optim_step()
    trained = learner.compute_logprobs(batch)
    # the rollout engine's copy: a plain model loading the merged weights scores tokens like the learner
    engine = K3ForCausalLM(model.config, init=False)
    engine.load_state_dict(learner.policy_state_dict())
    with torch.no_grad():
        out = engine(batch.tokens[:, :-1], use_cache=False, routed_experts=batch.routed_experts[:, :T - 1].long())
    lg = out.logits.float()
    lp = lg.gather(-1, batch.tokens[:, 1:, None])[..., 0] - lg.logsumexp(-1)
    mask = batch.response_mask[:, 1:]
    assert (lp - trained[:, 1:])[mask].abs().max() < 1e-4
    assert all(torch.equal(model.state_dict()[k], v) for k, v in base.items())  # base weights untouched
    # adapter-only export reloads into a fresh manager and gives the same policy
    path = tmp_path / "policy.safetensors"
    learner.save_adapter(path)
    assert set(learner.adapter_state_dict()) == set(LoRAAdapter.load(path, model).tensors())
    fresh = Learner(_model(), LearnerConfig(lora=LoRAConfig.preset("tiny", targets=("attn", "experts"))))
    fresh.adapter.load_tensors(LoRAAdapter.load(path, fresh.model).tensors())
    assert torch.equal(fresh.compute_logprobs(batch), trained)


def test_without_router_replay_reports_flips():
    model = _model()
    batch = _batch(model)
    learner = Learner(model, LearnerConfig(router_replay=False, lora=LoRAConfig.preset("tiny")), seed=0)
    m = learner.forward_backward(batch)
    assert m["router_flip_frac"] == 0.0  # same weights: the trainer routes like the rollout
    batch.routed_experts = None
    assert "router_flip_frac" not in learner.forward_backward(batch)


def test_bad_input_names_the_field():
    model = _model()
    good = _batch(model)
    learner = Learner(model, LearnerConfig(lora=LoRAConfig.preset("tiny")))

    def bad(match, **changes):
        b = Batch(**{**good.__dict__, **changes})
        with pytest.raises(ValueError, match=match):
            learner.forward_backward(b)

    bad("tokens must be an integer", tokens=good.tokens.float())
    bad("tokens must have", tokens=good.tokens[:, :1], response_mask=good.response_mask[:, :1])
    bad("tokens: ids must be in", tokens=good.tokens + 1000)
    bad("response_mask shape", response_mask=good.response_mask[:, 1:])
    bad(r"response_mask\[:, 0\]", response_mask=torch.ones(B, T, dtype=torch.bool))
    empty = good.response_mask.clone()
    empty[2] = False
    bad("empty responses", response_mask=empty)
    nan = good.rollout_logp.clone()
    nan[1, 6] = float("nan")
    bad("rollout_logp has 1 NaN/inf", rollout_logp=nan)
    bad("rollout_logp shape", rollout_logp=good.rollout_logp[:, 1:])
    bad("old_logp shape", old_logp=good.rollout_logp[:2])
    bad("advantages must be", advantages=torch.ones(B + 1))
    bad("advantages has NaN", advantages=torch.tensor([1.0, float("inf"), 0.0, 0.0]))
    bad("routed_experts: expert ids", routed_experts=good.routed_experts + 100)
    bad("routed_experts must hold integer", routed_experts=good.routed_experts.float())
    bad("routed_experts shape", routed_experts=good.routed_experts[:, :5])
    bad("routed_experts has", routed_experts=good.routed_experts[..., :1])
    bad("routed_experts is required", routed_experts=None)
    bad("seq_weights must be finite", seq_weights=torch.tensor([1.0, -1.0, 1.0, 1.0]))
    with pytest.raises(RuntimeError, match="forward_backward"):
        learner.optim_step()
    for kw, match in ((dict(lr=0.0), "lr"), (dict(agg="mean"), "agg"), (dict(kl_kind="k4"), "kl_kind"),
                      (dict(micro_batch_size=0), "micro_batch_size"), (dict(is_band=(2.0, 3.0)), "is_band"),
                      (dict(is_level="row"), "is_level"), (dict(eps_low=1.5), "eps_low")):
        with pytest.raises(ValueError, match=match):
            LearnerConfig(**kw)
    with pytest.raises(ValueError, match="ref_model"):
        Learner(model, LearnerConfig(lora=LoRAConfig.preset("tiny")), ref_model=model)


def test_nonfinite_gradient_skips_the_step():
    model = _model()
    batch = _batch(model)
    learner = Learner(model, LearnerConfig(lora=LoRAConfig.preset("tiny")))
    learner.forward_backward(batch)
    learner.params[0].grad[0, 0] = float("nan")
    before = [p.detach().clone() for p in learner.params]
    with pytest.raises(FloatingPointError, match="step skipped"):
        learner.optim_step()
    assert all(torch.equal(a, p) for a, p in zip(before, learner.params)) and learner.version == 0


@pytest.mark.gpu
def test_learner_step_on_gpu_matches_cpu():
    cpu = _model()
    batch = _batch(cpu)
    gpu = _model().cuda()
    lc = Learner(cpu, LearnerConfig(lr=1e-2, lora=LoRAConfig.preset("tiny")), seed=0)
    lg = Learner(gpu, LearnerConfig(lr=1e-2, lora=LoRAConfig.preset("tiny")), seed=0)
    mc, mg = lc.forward_backward(batch), lg.forward_backward(batch)
    assert abs(mc["loss"] - mg["loss"]) < 1e-4
    gc, gg = lc.optim_step()["grad_norm"], lg.optim_step()["grad_norm"]
    assert abs(gc - gg) < 1e-3 * gc
    assert (lc.compute_logprobs(batch) - lg.compute_logprobs(batch).cpu()).abs().max() < 1e-3


def test_failed_micro_batch_drops_the_whole_gradient(monkeypatch):
    model = _model()
    batch = _batch(model)
    learner = Learner(model, LearnerConfig(lora=LoRAConfig.preset("tiny")))
    learner.forward_backward(batch)  # an earlier, good call
    kept = [p.grad.clone() for p in learner.params]
    bad = batch.rollout_logp.clone()
    bad[3, 8] = float("inf")
    with pytest.raises(ValueError, match="old_logp has 1 NaN/inf"):  # caught by validation: nothing changes
        learner.forward_backward(Batch(**{**batch.__dict__, "old_logp": bad}), micro_batch_size=2)
    assert all(torch.equal(a, p.grad) for a, p in zip(kept, learner.params))
    # a failure the inputs cannot show (the model's log-probs turn NaN in the second micro-batch)
    calls = []
    real = learner._token_logp

    def flaky(*args):
        lp, used = real(*args)
        calls.append(1)
        return (lp * float("nan") if len(calls) == 2 else lp), used

    monkeypatch.setattr(learner, "_token_logp", flaky)
    with pytest.raises(ValueError, match="logp has .* NaN/inf"):
        learner.forward_backward(batch, micro_batch_size=2)
    assert all(p.grad is None for p in learner.params)  # the first micro-batch's gradient went too
    with pytest.raises(RuntimeError, match="forward_backward"):
        learner.optim_step()
