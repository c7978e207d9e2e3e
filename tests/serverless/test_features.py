"""Service features beyond the core calls: Router Replay through Datum.loss_fn_inputs, forward_backward_custom,
the cispo loss, the merged-checkpoint download, and the retention rule for sampler snapshots (durable across a
restart). Each with its bad inputs refused (4xx naming the field) and nothing applied."""
import dataclasses
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load as load_safetensors

from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.serverless import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient, ServiceError
from k3.serverless.losses import LossConfig, session_loss
from k3.serverless.server import ServerThread
from k3.serverless.service import Service

from _serverless_helpers import rand_datum, tiny_config

ADAM = AdamParams(learning_rate=1e-2)
N_MOE, TOP_K, N_EXPERTS = 7, 2, 8     # the tiny preset's MoE layers, experts per token, experts


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    st = ServerThread(tiny_config(tmp_path_factory.mktemp("features"), keep_samplers=2))
    with st as url:
        c = ServiceClient(url)
        yield c, st.service
        c.close()


def _weights(tc) -> dict:
    return load_safetensors(tc.download_weights())


def _refused(fn, status: int, *fragments: str) -> None:
    with pytest.raises(ServiceError) as e:
        fn()
    assert e.value.status == status, e.value
    for f in fragments:
        assert f in e.value.detail, e.value.detail


def _with(d: Datum, **inputs) -> Datum:
    return Datum(d.model_input, {**d.loss_fn_inputs, **inputs})


# ---------------------------------------------------------------------------------------------- Router Replay
def test_router_replay_through_the_service(server):
    client, _ = server
    tc = client.create_lora_training_client("k3-tiny", rank=4, seed=21)
    sc = tc.save_weights_and_get_sampling_client("r3")
    prompt = list(rand_datum(1, n=12).model_input.tokens)
    seq = sc.sample(ModelInput.from_ints(prompt), 1, SamplingParams(max_tokens=5, seed=3),
                    return_routed_experts=True).sequences[0]
    assert len(seq.routed_experts) == 5 and all(len(x) == N_MOE and len(x[0]) == TOP_K for x in seq.routed_experts)
    assert sc.sample(ModelInput.from_ints(prompt), 1, SamplingParams(max_tokens=5, seed=3)).sequences[0] \
        .routed_experts is None
    # the datum: prompt + generated tokens; position len(prompt) - 1 + i produced token i
    toks = prompt + seq.tokens
    n = len(toks) - 1
    free = [[-1] * TOP_K] * N_MOE
    routed = [free] * (len(prompt) - 1) + seq.routed_experts[:n - len(prompt) + 1]
    base = Datum(ModelInput.from_ints(toks[:-1]), {"target_tokens": toks[1:]})
    plain = tc.forward([base], "cross_entropy").loss_fn_outputs[0]["logprobs"]
    replayed = tc.forward([_with(base, routed_experts=routed)], "cross_entropy").loss_fn_outputs[0]["logprobs"]
    # same adapter, same tokens: the trainer routes as the sampler did, so replay changes (next to) nothing
    assert max(abs(a - b) for a, b in zip(plain, replayed)) < 1e-4
    assert tc.forward([_with(base, routed_experts=[free] * n)], "cross_entropy").loss_fn_outputs[0]["logprobs"] \
        == plain                                                      # all -1: routed freely, bit for bit
    forced = [[[(e + 1) % N_EXPERTS for e in layer] for layer in x] for x in routed[len(prompt) - 1:]]
    other = tc.forward([_with(base, routed_experts=routed[: len(prompt) - 1] + forced)], "cross_entropy")
    assert other.loss_fn_outputs[0]["logprobs"][len(prompt):] != plain[len(prompt):]   # replay is applied
    fb = tc.forward_backward([_with(base, routed_experts=routed)], "cross_entropy")
    assert fb.metrics["num_tokens"] == n
    field = "data[0].loss_fn_inputs.routed_experts"
    bad = [[[N_EXPERTS] * TOP_K] * N_MOE] * n                         # id out of range
    _refused(lambda: tc.forward_backward([_with(base, routed_experts=bad)], "cross_entropy"), 400, field)
    _refused(lambda: tc.forward([_with(base, routed_experts=[free[:3]] * n)], "cross_entropy"), 400, field,
             f"{N_MOE} MoE layers")
    half = [[[-1, 3]] * N_MOE] * n                                    # one id recorded, the other not
    _refused(lambda: tc.forward([_with(base, routed_experts=half)], "cross_entropy"), 400, field)
    _refused(lambda: tc.forward([_with(base, routed_experts=routed[:-1])], "cross_entropy"), 400, field)
    assert tc.get_info()["pending"] == 1                              # the refused calls added no gradient


# ---------------------------------------------------------------------------------------------- custom loss
def test_forward_backward_custom(server):
    client, _ = server
    data = [rand_datum(30 + i) for i in range(2)]
    a = client.create_lora_training_client("k3-tiny", rank=4, seed=22)
    b = client.create_lora_training_client("k3-tiny", rank=4, seed=22)
    a.forward_backward(data, "cross_entropy")
    a.optim_step(ADAM)

    def ce(batch, lps):   # cross-entropy written as a custom loss: -sum of the weighted log-probs
        w = [torch.tensor(d.loss_fn_inputs["weights"]) for d in batch]
        return -sum((wi * lp).sum() for wi, lp in zip(w, lps)), {"rows": float(len(lps))}

    out = b.forward_backward_custom(data, ce)
    assert out.metrics["rows"] == 2.0 and len(out.loss_fn_outputs) == 2
    b.optim_step(ADAM)
    wa, wb = _weights(a), _weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)       # d(-sum w lp)/d lp = -w exactly: the same gradient

    def seq_logprob_sq(batch, lps):   # a loss no built-in has: the square of each sequence's mean log-prob
        return sum(lp.mean() ** 2 for lp in lps), {}

    before = _weights(b)
    out = b.forward_backward_custom(data, seq_logprob_sq)
    want = sum(torch.tensor(o["logprobs"]).mean() ** 2 for o in out.loss_fn_outputs)
    assert abs(out.metrics["loss"] - float(want)) < 1e-4
    assert b.optim_step(ADAM).metrics["grad_norm"] > 0
    assert not all(torch.equal(before[k], v) for k, v in _weights(b).items())
    with pytest.raises(TypeError, match="scalar"):
        b.forward_backward_custom(data, lambda batch, lps: (torch.stack(lps[:1][0:1]), {}))
    _refused(lambda: b.forward_backward([data[0]], "logprob_linear"), 400,
             "data[0].loss_fn_inputs.logprob_grads")


# ---------------------------------------------------------------------------------------------- cispo
def test_cispo_follows_its_definition():
    torch.manual_seed(2)
    lp = (-torch.rand(2, 5) * 3).requires_grad_()
    old = lp.detach() + 0.3 * torch.randn(2, 5)
    adv = torch.randn(2, 5)
    w = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.float32)
    cfg = LossConfig(cispo_clip_low=0.1, cispo_clip_high=0.1)
    loss, m = session_loss("cispo", lp, {"weights": w, "logprobs": old, "advantages": adv}, cfg)
    r = torch.exp(lp.detach() - old).clamp(0.9, 1.1)
    assert torch.allclose(loss, -(w * r * adv * lp).sum())
    loss.backward()
    assert torch.allclose(lp.grad, -(w * r * adv))          # the clipped weight is a constant: every token's gradient
    assert 0 < m["clip_frac"] <= 1


def test_cispo_through_the_service(server):
    client, _ = server
    tc = client.create_lora_training_client("k3-tiny", rank=4, seed=23)
    data = [rand_datum(40 + i, loss_fn="gspo") for i in range(2)]
    fb = tc.forward_backward(data, "cispo", {"cispo_clip_high": 2.0})
    assert set(fb.metrics) >= {"loss", "clip_frac", "num_tokens"}
    assert tc.optim_step(ADAM).metrics["grad_norm"] > 0
    _refused(lambda: tc.forward_backward(data, "cispo", {"cispo_clip_high": 1000.0}), 400,
             "loss_fn_config.cispo_clip_high")
    _refused(lambda: tc.forward_backward([rand_datum(1)], "cispo"), 400, "data[0].loss_fn_inputs.logprobs")
    assert "cispo" in client.get_server_capabilities()["loss_fns"]


# ---------------------------------------------------------------------------------------------- merge
def test_merged_checkpoint_serves_without_lora(server):
    client, _ = server
    tc = client.create_lora_training_client("k3-tiny", rank=8, seed=24)
    for _ in range(2):
        tc.forward_backward([rand_datum(50)], "cross_entropy")
        tc.optim_step(ADAM)
    raw = tc.download_merged_weights()
    path = server[1].store.root / "merged-test.safetensors"
    path.write_bytes(raw)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    assert meta["format"] == "k3-merged" and meta["step"] == "2"
    model = K3ForCausalLM(K3Config.from_dict(json.loads(meta["config"]))).eval()
    model.load_state_dict(load_safetensors(raw))
    toks = list(rand_datum(51, n=20).model_input.tokens)
    with torch.no_grad():
        logits = model(torch.tensor([toks]), use_cache=False).logits[0].float()
    lp = (logits[:-1].gather(-1, torch.tensor(toks[1:])[:, None])[:, 0] - torch.logsumexp(logits[:-1], -1))
    want = tc.save_weights_and_get_sampling_client("m").compute_logprobs(ModelInput.from_ints(toks))[1:]
    assert torch.allclose(lp, torch.tensor(want), atol=1e-4)
    assert not torch.allclose(lp, torch.tensor(client.create_lora_training_client("k3-tiny", rank=8, seed=24)
                                               .save_weights_and_get_sampling_client("b")
                                               .compute_logprobs(ModelInput.from_ints(toks))[1:]), atol=1e-4)


# ---------------------------------------------------------------------------------------------- retention
def test_old_snapshots_are_removed(server):
    client, service = server
    tc = client.create_lora_training_client("k3-tiny", rank=4, seed=25)
    samplers = [tc.save_weights_and_get_sampling_client(f"v{i}") for i in range(3)]
    assert tc.get_info()["samplers"] == sorted(s.sampler_id for s in samplers[1:])   # keep_samplers = 2
    _refused(lambda: samplers[0].sample(ModelInput.from_ints([1, 2]), 1), 410, "sampler_id", "retention")
    assert samplers[2].sample(ModelInput.from_ints([1, 2]), 1, SamplingParams(max_tokens=2)).sequences
    files = {p.name for p in (service.store.root / "samplers").iterdir()}
    assert f"{samplers[0].sampler_id}.safetensors" not in files
    assert {f"{s.sampler_id}.safetensors" for s in samplers[1:]} <= files


def test_retention_is_durable_across_restart(tmp_path):
    cfg = tiny_config(tmp_path / "data", keep_samplers=3)
    svc = Service(cfg)
    try:
        sid, _ = svc.create_session("k3-tiny", 4, seed=1)
        ids = [svc.save_sampler(svc.sessions[sid], f"v{i}")["sampler_id"] for i in range(3)]
    finally:
        svc.close()
    orphan = tmp_path / "data" / "samplers" / "s-gone.x.0.safetensors"   # as a crash after a row's removal leaves it
    orphan.write_bytes(b"x")
    svc = Service(dataclasses.replace(cfg, keep_samplers=1))            # a stricter rule at the next start
    try:
        assert sorted(svc.samplers) == [ids[-1]]
        assert [r[0] for r in svc.store.samplers()] == [ids[-1]]
        assert sorted(p.name for p in (tmp_path / "data" / "samplers").iterdir()) == [f"{ids[-1]}.safetensors"]
        s = svc.sessions[sid]
        toks = [3, 4, 5]
        assert len(svc.compute_logprobs(ids[-1], s, toks)) == 3           # the kept one still serves
    finally:
        svc.close()


def test_the_job_puts_each_tokens_routing_at_the_position_that_produced_it():
    """k3 rl --serverless with rl.router_replay: turn tokens' routings land at their producing positions (the
    token before), everything else routes freely."""
    from k3.envs.calc_task import Episode, Task
    from k3.serverless.job import Rollout, gspo_data
    from k3.serverless.types import SampledSequence

    def routing(e):
        return [[e, e + 1]] * N_MOE

    ep = Episode(Task("1+1", 2), [5, 6, 7], [False] * 3)
    r = Rollout(ep, [0.0] * 3)
    ep.tokens += [8, 9, 10]                                 # a turn of two tokens, then one tool-output token
    ep.model_mask += [True, True, False]
    r.add_turn(SampledSequence([8, 9], [-1.0, -2.0], "stop", [routing(0), routing(2)]), [10], 3)
    ep.tokens += [11]                                       # a second turn of one token
    ep.model_mask += [True]
    r.add_turn(SampledSequence([11], [-3.0], "stop", [routing(4)]), [], 6)
    assert r.logprobs == [0.0, 0.0, 0.0, -1.0, -2.0, 0.0, -3.0]
    d = gspo_data([r], [1.0])[0]
    free = [[-1, -1]] * N_MOE
    assert d.loss_fn_inputs["routed_experts"] == [free, free, routing(0), routing(2), free, routing(4)]
    assert d.loss_fn_inputs["weights"] == [0.0, 0.0, 1.0, 1.0, 0.0, 1.0]


@pytest.mark.parametrize("field,value", [("device", "tpu"), ("batch_wait_ms", -1), ("batch_wait_ms", 5000),
                                         ("keep_samplers", 0)])
def test_new_settings_are_checked_naming_the_field(field, value):
    from k3.serverless.config import ServeConfig

    with pytest.raises(ValueError, match=f"^{field}:"):
        dataclasses.replace(ServeConfig(), **{field: value}).validate()


def test_return_routed_experts_must_be_a_bool(server):
    client, service = server
    tc = client.create_lora_training_client("k3-tiny", rank=4, seed=26)
    sampler = tc.save_weights_for_sampler("rb")
    s = service.authorize_sampler(sampler, tc.api_key)
    _refused(lambda: service.sample(sampler, s, [1, 2], 1, {"max_tokens": 2}, return_routed_experts="yes"), 400,
             "return_routed_experts")


def test_engine_defaults_follow_the_device_and_a_toml_engine_table_overrides_fields_of_them(tmp_path):
    """On CUDA the service's engine batches decode (64 rows) and prefill (8 segments) so that concurrent sessions meet
    in one forward; on CPU those padded rows would only cost compute. A TOML [engine] table changes the fields it
    names and keeps the device's defaults for the rest."""
    from k3.serverless.config import ServeConfig, engine_defaults

    cpu, cuda = engine_defaults("cpu"), engine_defaults("cuda")
    assert (cuda.decode_batch, cuda.prefill_batch, cuda.max_step_tokens) == (64, 8, 1024)
    assert cpu.prefill_batch == 1 and cpu.decode_batch < cuda.decode_batch
    assert ServeConfig(device="cuda").engine_config() == cuda
    assert ServeConfig(device="cpu").engine_config() == cpu
    path = tmp_path / "serve.toml"
    path.write_text('device = "cuda"\n[engine]\ndecode_batch = 16\n')
    eng = ServeConfig.from_toml(path).engine_config()
    assert (eng.decode_batch, eng.prefill_batch, eng.max_step_tokens) == (16, 8, 1024)
    path.write_text('device = "cpu"\n[engine]\nmax_running = 8\n')
    assert ServeConfig.from_toml(path).engine_config() == dataclasses.replace(cpu, max_running=8)
