"""The service over HTTP (one loopback server for the module): Tinker-shaped calls, sync and async; isolation
between sessions (403), bad requests (4xx naming the field, nothing applied, the next request unharmed), limits
stated in the refusal, an optimizer step that is whole or not at all, concurrent sessions bitwise equal to
the same sessions run one after another."""
import threading
from concurrent.futures import Future

import httpx
import pytest
from safetensors.torch import load as load_safetensors

import k3.serverless.service as service_mod
from k3.serverless import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient, ServiceError
from k3.serverless.config import ServeConfig
from k3.serverless.server import ServerThread

from _serverless_helpers import rand_datum, tiny_config

ADAM = AdamParams(learning_rate=1e-2)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cfg = tiny_config(tmp_path_factory.mktemp("serve"))
    st = ServerThread(cfg)
    with st as url:
        yield url, st.service


@pytest.fixture(scope="module")
def client(server):
    c = ServiceClient(server[0])
    yield c
    c.close()


def _weights(tc) -> dict:
    return load_safetensors(tc.download_weights())


def _same(a: dict, b: dict) -> bool:
    import torch
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _train(tc, data, steps, loss_fn="cross_entropy"):
    out = []
    for _ in range(steps):
        fb = tc.forward_backward(data, loss_fn)
        tc.optim_step(ADAM)
        out.append(fb.metrics["loss"])
    return out


def test_loopback_by_default():
    assert ServeConfig().host == "127.0.0.1"


def test_training_sampling_and_logprobs(client):
    tc = client.create_lora_training_client(base_model="k3-tiny", rank=8, seed=1)
    data = [rand_datum(i) for i in range(3)]
    losses = _train(tc, data, 4)
    assert losses[-1] < losses[0]                      # cross-entropy on fixed data goes down
    assert tc.get_info()["step"] == 4
    sc = tc.save_weights_and_get_sampling_client("after4")
    prompt = ModelInput.from_ints(list(data[0].model_input.tokens[:10]))
    res = sc.sample(prompt, num_samples=3, sampling_params=SamplingParams(max_tokens=6, temperature=1.0, seed=5))
    assert len(res.sequences) == 3 and all(len(s.tokens) == 6 == len(s.logprobs) for s in res.sequences)
    again = sc.sample(prompt, num_samples=3, sampling_params=SamplingParams(max_tokens=6, temperature=1.0, seed=5))
    assert again == res                                # seeded sampling is reproducible
    seq = res.sequences[0]
    lp = sc.compute_logprobs(ModelInput.from_ints(prompt.to_ints() + seq.tokens))
    assert lp[0] is None and len(lp) == 10 + 6
    assert max(abs(a - b) for a, b in zip(lp[10:], seq.logprobs)) < 1e-4
    # the snapshot is immutable: training on does not change what it samples
    _train(tc, data, 1)
    assert sc.sample(prompt, num_samples=3, sampling_params=SamplingParams(max_tokens=6, seed=5)) == res


def test_async_futures(client):
    tc = client.create_lora_training_client(base_model="k3-tiny", rank=4, seed=2)
    f = tc.forward_backward_async([rand_datum(7)], "cross_entropy")
    assert isinstance(f, Future)
    assert f.result().loss_fn_outputs[0]["logprobs"]
    assert tc.optim_step_async(ADAM).result().step == 1
    sc = tc.save_weights_and_get_sampling_client_async("s").result()
    assert len(sc.sample_async(ModelInput.from_ints([1, 2, 3]), 2, SamplingParams(max_tokens=3)).result()
               .sequences) == 2
    assert client.create_lora_training_client_async("k3-tiny", rank=2).result().session_id


def test_a_key_reaches_only_its_own_session(server, client):
    url = server[0]
    a = client.create_lora_training_client(base_model="k3-tiny", rank=4, seed=3)
    b = client.create_lora_training_client(base_model="k3-tiny", rank=4, seed=4)
    a.forward_backward([rand_datum(1)], "cross_entropy")
    sampler = a.save_weights_for_sampler("mine")
    before = _weights(a)
    sid = a.session_id
    datum = rand_datum(2).to_json()
    calls = [("GET", f"/v1/sessions/{sid}", None), ("GET", f"/v1/sessions/{sid}/weights", None),
             ("GET", f"/v1/sessions/{sid}/merged_weights", None),
             ("POST", f"/v1/sessions/{sid}/forward_backward", {"data": [datum], "loss_fn": "cross_entropy"}),
             ("POST", f"/v1/sessions/{sid}/forward", {"data": [datum], "loss_fn": "cross_entropy"}),
             ("POST", f"/v1/sessions/{sid}/optim_step", {"adam_params": {}}),
             ("POST", f"/v1/sessions/{sid}/save_state", {"name": "x"}),
             ("POST", f"/v1/sessions/{sid}/load_state", {"name": "x"}),
             ("POST", f"/v1/sessions/{sid}/samplers", {"name": "x"}),
             ("POST", f"/v1/samplers/{sampler}/sample", {"prompt": [1, 2], "num_samples": 1}),
             ("POST", f"/v1/samplers/{sampler}/logprobs", {"prompt": [1, 2]}),
             ("DELETE", f"/v1/sessions/{sid}", None)]
    for key in (b.api_key, None, "k3-forged", a.api_key + "x"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        for method, path, body in calls:
            r = httpx.request(method, url + path, json=body, headers=headers)
            assert r.status_code == 403, (method, path, key, r.status_code)
            assert "api_key" in r.json()["detail"]
    assert a.get_info()["step"] == 0 and a.get_info()["pending"] == 1
    assert _same(before, _weights(a))
    r = httpx.get(url + "/v1/sessions/s-nonexistent", headers={"Authorization": f"Bearer {a.api_key}"})
    assert r.status_code == 404


def _refused(fn, status: int, *fragments: str) -> None:
    with pytest.raises(ServiceError) as e:
        fn()
    assert e.value.status == status, e.value
    for f in fragments:
        assert f in e.value.detail, e.value.detail


def test_bad_requests_name_the_field_and_change_nothing(server, client):
    url = server[0]
    _refused(lambda: client.create_lora_training_client("k3-tiny", rank=0), 400, "rank", "[1, 64]")
    _refused(lambda: client.create_lora_training_client("k3-tiny", rank=65), 400, "rank", "[1, 64]")
    _refused(lambda: client.create_lora_training_client("llama", rank=4), 400, "base_model")
    tc = client.create_lora_training_client("k3-tiny", rank=4, seed=9)
    d = rand_datum(3)
    good = _weights(tc)
    n = d.model_input.length
    bad_calls = [
        (lambda: tc.forward_backward([d] * 17, "cross_entropy"), 413, "data", "limit of 16"),
        (lambda: tc.forward_backward([d], "dpo"), 400, "loss_fn"),
        (lambda: tc.forward_backward([d], "gspo"), 400, "data[0].loss_fn_inputs.logprobs"),
        (lambda: tc.forward_backward([Datum(ModelInput.from_ints([1, 2, 9999]),
                                            {"target_tokens": [1, 2, 3]})], "cross_entropy"), 400,
         "data[0].model_input", "vocabulary"),
        (lambda: tc.forward_backward([Datum(d.model_input, {"target_tokens": [1] * (n - 1)})], "cross_entropy"),
         400, "data[0].loss_fn_inputs.target_tokens"),
        (lambda: tc.forward_backward([Datum(d.model_input, {**d.loss_fn_inputs, "weights": [-1.0] * n})],
                                     "cross_entropy"), 400, "weights"),
        (lambda: tc.forward_backward([Datum(ModelInput.from_ints([1] * 97), {"target_tokens": [1] * 97})],
                                     "cross_entropy"), 413, "limit of 96"),
        (lambda: tc.forward_backward([rand_datum(3, loss_fn="ppo")], "ppo", {"clip_low": 2.0}), 400, "loss_fn_config.clip_low"),
        (lambda: tc.optim_step(AdamParams(learning_rate=-1.0)), 400, "adam_params.learning_rate"),
        (lambda: tc.optim_step(ADAM), 409, "no gradient"),
        (lambda: tc.save_state("../etc"), 400, "name"),
        (lambda: tc.load_state("never-saved"), 404, "never-saved"),
    ]
    for fn, status, *frags in bad_calls:
        _refused(fn, status, *frags)
    sc = tc.save_weights_and_get_sampling_client("s0")
    _refused(lambda: sc.sample(ModelInput.from_ints([1]), 9), 413, "num_samples", "[1, 8]")
    _refused(lambda: sc.sample(ModelInput.from_ints([1]), 1, SamplingParams(max_tokens=17)), 413, "max_tokens",
             "limit of 16")
    _refused(lambda: sc.sample(ModelInput.from_ints([1]), 1, SamplingParams(max_tokens=4, temperature=-1.0)), 400,
             "sampling_params.temperature")
    h = {"Authorization": f"Bearer {tc.api_key}", "content-type": "application/json"}
    for body, frag in ((b"{not json", "body"), (b"[1, 2]", "body"), (b'{"data": [], "loss_fn": "cross_entropy"}',
                                                                     "data"),
                       (b'{"data": [{"model_input": [1]}], "oops": 1}', "oops")):
        r = httpx.post(f"{url}/v1/sessions/{tc.session_id}/forward_backward", content=body, headers=h)
        assert r.status_code == 400 and frag in r.json()["detail"], (body, r.text)
    assert tc.get_info()["step"] == 0 and tc.get_info()["pending"] == 0
    assert _same(good, _weights(tc))
    # the next good request is unharmed, and matches a session that never saw a bad request
    ref = client.create_lora_training_client("k3-tiny", rank=4, seed=9)
    assert _train(tc, [d], 2) == _train(ref, [d], 2)
    assert _same(_weights(tc), _weights(ref))


def test_optimizer_step_is_whole_or_not_at_all(server, client, monkeypatch):
    tc = client.create_lora_training_client("k3-tiny", rank=4, seed=11)
    ref = client.create_lora_training_client("k3-tiny", rank=4, seed=11)
    d = [rand_datum(21), rand_datum(22)]
    _train(tc, d, 1)
    _train(ref, d, 1)
    tc.forward_backward(d, "cross_entropy")
    before = _weights(tc)

    def fail(*a, **k):
        raise OSError("disk full (injected)")
    monkeypatch.setattr(service_mod, "write_tensors", fail)
    _refused(lambda: tc.optim_step(ADAM), 500, "disk full")
    monkeypatch.undo()
    assert tc.get_info()["step"] == 1 and tc.get_info()["pending"] == 1     # nothing applied, gradient kept
    assert _same(before, _weights(tc))
    tc.optim_step(ADAM)                                                     # the retry is the step
    _train(ref, d, 1)
    assert _same(_weights(tc), _weights(ref))
    _train(tc, d, 1)
    _train(ref, d, 1)
    assert _same(_weights(tc), _weights(ref))


def test_concurrent_sessions_equal_their_runs_one_after_another(server, client):
    service = server[1]
    losses = ["cross_entropy", "gspo", "importance_sampling", "ppo"]
    data = {i: [rand_datum(100 * i + j, loss_fn=losses[i]) for j in range(2 + i)] for i in range(4)}
    solo = {}
    for i in range(4):   # one after another
        tc = client.create_lora_training_client("k3-tiny", rank=2 ** (i + 1), seed=40 + i)
        _train(tc, data[i], 2, losses[i])
        solo[i] = _weights(tc)
    rounds0 = len(service.scheduler.batches)
    conc = {}
    barrier = threading.Barrier(4)

    def worker(i):
        tc = client.create_lora_training_client("k3-tiny", rank=2 ** (i + 1), seed=40 + i)
        barrier.wait()
        _train(tc, data[i], 2, losses[i])
        conc[i] = _weights(tc)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(_same(solo[i], conc[i]) for i in range(4))
    shared = [b for b in service.scheduler.batches[rounds0:] if b[0] == "forward_backward" and b[1] > 1]
    assert shared, "no forward_backward round batched several sessions"


def test_deleted_session_is_gone(client):
    tc = client.create_lora_training_client("k3-tiny", rank=2, seed=5)
    sc = tc.save_weights_and_get_sampling_client("x")
    tc.delete()
    _refused(lambda: tc.get_info(), 404, "session_id")
    _refused(lambda: sc.sample(ModelInput.from_ints([1]), 1), 404, "sampler_id")


def test_stats_account_for_the_rounds_and_the_engine_work(server, client):
    """The load test reads where the server's time went from /v1/stats (benchmarks/serverless.py): the counters must
    move with the calls made, by kind, or its per-phase breakdown says nothing."""
    url, _ = server
    before = httpx.get(url + "/v1/stats").json()
    tc = client.create_lora_training_client(base_model="k3-tiny", rank=4, seed=3)
    tc.forward_backward([rand_datum(7)], "cross_entropy")
    sc = tc.save_weights_and_get_sampling_client("stats")
    sc.sample(ModelInput.from_ints([5, 6, 7]), num_samples=2, sampling_params=SamplingParams(max_tokens=3, seed=1))
    after = httpx.get(url + "/v1/stats").json()
    kinds_before, kinds = before.get("rounds_by_kind", {}), after["rounds_by_kind"]
    for kind in ("forward_backward", "sample"):
        was = kinds_before.get(kind, {"rounds": 0, "rows": 0, "seconds": 0.0})
        assert kinds[kind]["rounds"] >= was["rounds"] + 1 and kinds[kind]["seconds"] > was["seconds"], kind
    assert kinds["sample"]["rows"] >= kinds_before.get("sample", {"rows": 0})["rows"] + 2   # rows = samples
    assert after["engine"]["forwards"] > before["engine"]["forwards"]
    # no stop tokens: 2 samples x 3 tokens
    assert after["engine"]["generated_tokens"] == before["engine"]["generated_tokens"] + 2 * 3
    assert after["sample_generate_s"] > before["sample_generate_s"]
    tc.delete()
