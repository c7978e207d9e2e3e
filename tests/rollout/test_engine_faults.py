"""Engine hardening: every bad request is refused before admission with the field named, and an exception at any
stage after admission (admission itself, prefill, decode, sampling, checkpointing, spill, restore) releases
exactly that call's sequences: the engine's invariants hold afterwards and it serves bitwise what a fresh engine
serves. Found by a user: `top_k=2.5` used to fail inside sampling and wedge the engine for good."""
import math

import pytest
import torch

from k3.rollout import Engine, RequestFailed, SamplingParams

from _engine_helpers import SMALL, TINY_POOLS, rand_tokens, same, workload


class InjectedFault(RuntimeError):
    pass


class FailOn:
    """Wraps `fn`: the `nth` call for which `when(*args)` holds raises InjectedFault; other calls pass through."""

    def __init__(self, fn, nth: int, when=lambda *a, **k: True):
        self.fn, self.nth, self.when, self.seen, self.fired = fn, nth, when, 0, False

    def __call__(self, *args, **kwargs):
        if not self.fired and self.when(*args, **kwargs):
            self.seen += 1
            if self.seen == self.nth:
                self.fired = True
                raise InjectedFault(f"injected on call {self.nth}")
        return self.fn(*args, **kwargs)


def engine(model) -> Engine:
    return Engine(model, prefix_cache=True, **TINY_POOLS, **SMALL)


@pytest.fixture(scope="module")
def reference(model):
    """What a fresh engine serves for the workload (and, as its first seedless request, for one more prompt)."""
    eng = engine(model)
    return workload(eng, greedy=False), engine(model).generate([rand_tokens(23, 40)], SamplingParams(max_tokens=5))


def _install(stage: str, eng: Engine, model, monkeypatch) -> FailOn:
    import k3.rollout.engine as engine_mod
    targets = {
        # admission: a cached path's pages are retained and the state copied, then the pins fail
        "admission": (eng.pages, "pin", 2, lambda *a: True),
        "admission_state": (eng.states, "alloc", 4, lambda *a: True),
        "prefill": (model, "forward", 5, lambda ids, *a, **k: ids.shape[1] > 1),
        "decode": (model, "forward", 6, lambda ids, *a, **k: ids.shape[1] == 1),
        "sampling": (engine_mod, "sample", 9, lambda *a: True),
        "checkpoint": (eng.tree, "insert", 4, lambda *a, **k: True),
        "spill": (eng.states, "_spill", 1, lambda *a: True),
        "restore": (eng.pages, "ensure_device", 1, lambda i: eng.pages.items[i].tier == "host"),
    }
    obj, name, nth, when = targets[stage]
    fault = FailOn(getattr(obj, name), nth, when)
    monkeypatch.setattr(obj, name, fault)
    return fault


STAGES = ["admission", "admission_state", "prefill", "decode", "sampling", "checkpoint", "spill", "restore"]


@pytest.mark.parametrize("stage", STAGES)
def test_failure_at_any_stage_releases_the_call_and_the_engine_serves_on(model, reference, stage, monkeypatch):
    want, want_seedless = reference
    eng = engine(model)
    with monkeypatch.context() as m:
        fault = _install(stage, eng, model, m)
        with pytest.raises(RequestFailed, match="InjectedFault") as err:
            workload(eng, greedy=False)
        assert fault.fired and isinstance(err.value.__cause__, InjectedFault)
    assert eng.running == []
    eng.check()   # refcounts equal the holders: nothing of the failed call is still held
    held_pages = sum(len(n.pages) for n in eng.tree.nodes())
    assert eng.pages.used("device") + eng.pages.used("host") <= held_pages
    # the request-seed counter was restored: a seedless request gets what a fresh engine's first one gets
    assert same(eng.generate([rand_tokens(23, 40)], SamplingParams(max_tokens=5)), want_seedless)
    eng.check_each_step = True
    assert same(workload(eng, greedy=False), want)
    assert eng.cache_stats()["failed_calls"] == 1


def test_the_reported_request_no_longer_wedges_the_engine(model):
    eng = Engine(model, prefix_cache=True, **SMALL)
    with pytest.raises(ValueError, match=r"sampling\.top_k: expected an integer, got float \(2\.5\)"):
        eng.generate([[5, 6, 7]], SamplingParams(top_k=2.5, max_tokens=2))
    assert eng.running == [] and eng.cache_stats()["requests"] == 0
    eng.update_weights(None, 1)
    out = eng.generate([[5, 6, 7]], SamplingParams(top_k=2, max_tokens=2, seed=1))
    assert len(out[0].token_ids) == 2


BAD_REQUESTS = [
    ([[1, 2]], SamplingParams(temperature=math.inf), r"sampling\.temperature: must be finite"),
    ([[1, 2]], SamplingParams(temperature=math.nan), r"sampling\.temperature"),
    ([[1, 2]], SamplingParams(temperature=-0.5), r"sampling\.temperature"),
    ([[1, 2]], SamplingParams(temperature="1"), r"sampling\.temperature: expected a number"),
    ([[1, 2]], SamplingParams(top_p=math.nan), r"sampling\.top_p"),
    ([[1, 2]], SamplingParams(top_k=-1), r"sampling\.top_k: must be >= 0"),
    ([[1, 2]], SamplingParams(max_tokens=2.5), r"sampling\.max_tokens: expected an integer"),
    ([[1, 2]], SamplingParams(max_tokens=True), r"sampling\.max_tokens: expected an integer, got bool"),
    ([[1, 2]], SamplingParams(max_tokens=0), r"sampling\.max_tokens: must be >= 1"),
    ([[1, 2]], SamplingParams(n=0), r"sampling\.n: must be >= 1"),
    ([[1, 2]], SamplingParams(seed=-3), r"sampling\.seed: must be >= 0"),
    ([[1, 2]], SamplingParams(seed=1.5), r"sampling\.seed: expected an integer"),
    ([[1, 2]], SamplingParams(stop_token_ids=7), r"sampling\.stop_token_ids: expected a tuple"),
    ([[1, 2]], SamplingParams(stop_token_ids=(1.0,)), r"sampling\.stop_token_ids: expected an integer"),
    ([[1, 2]], SamplingParams(stop_token_ids=(10**6,)), r"sampling\.stop_token_ids: \[1000000\] outside"),
    ([[1, 2]], SamplingParams(adapter_id="lora-a"), r"sampling\.adapter_id: unknown adapter 'lora-a'"),
    ([[1, 2]], SamplingParams(adapter_id=""), r"sampling\.adapter_id: expected None or a non-empty"),
    ([[1, 2.5]], SamplingParams(), r"prompts\[0\]\[1\]: token ids must be integers, got float"),
    ([[True, 2]], SamplingParams(), r"prompts\[0\]\[0\]: token ids must be integers, got bool"),
    (["abc"], SamplingParams(), r"prompts\[0\]: expected a list of token ids, got str"),
    ([torch.tensor([1.0, 2.0])], SamplingParams(), r"prompts\[0\]: a tensor prompt must be a 1-D integer"),
    ([[1, 2], [3, 10**6]], SamplingParams(), r"prompts\[1\]: token ids must be in"),
    ([[1, 2], [3]], [SamplingParams(), SamplingParams(top_k=0.5)], r"sampling\[1\]\.top_k"),
    ([[1, 2]], [{"temperature": 0.0}], r"sampling\[0\]: expected SamplingParams, got dict"),
    ([[1, 2]], [SamplingParams(), SamplingParams()], r"sampling: 2 SamplingParams for 1 prompts"),
    ([], SamplingParams(), r"prompts: expected a non-empty list"),
]


@pytest.mark.parametrize("prompts,sampling,match", BAD_REQUESTS, ids=[m[2][:40] for m in BAD_REQUESTS])
def test_bad_requests_are_refused_before_admission(model, prompts, sampling, match):
    eng = Engine(model, prefix_cache=True, **SMALL)
    good = eng.generate([rand_tokens(9, 1)], SamplingParams(temperature=0.0, max_tokens=2))
    before = eng.cache_stats()
    with pytest.raises(ValueError, match=match):
        eng.generate(prompts, sampling)
    assert eng.running == [] and eng.cache_stats() == before   # nothing admitted, nothing computed
    eng.check()
    again = eng.generate([rand_tokens(9, 1)], SamplingParams(temperature=0.0, max_tokens=2))
    assert same(again, good)


def test_prompt_length_is_checked_against_max_position_embeddings(model, monkeypatch):
    monkeypatch.setattr(model.config, "max_position_embeddings", 50)
    eng = Engine(model, prefix_cache=True, **SMALL)
    with pytest.raises(ValueError, match=r"prompts\[0\]: 51 prompt tokens \+ max_tokens 1 exceed .*50"):
        eng.generate([rand_tokens(51, 2)], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match=r"prompts\[0\]: 45 prompt tokens \+ max_tokens 10 exceed"):
        eng.generate([rand_tokens(45, 2)], SamplingParams(max_tokens=10))
    assert len(eng.generate([rand_tokens(45, 2)], SamplingParams(max_tokens=5))[0].token_ids) <= 5


def test_policy_versions_only_move_forward_and_bad_weights_change_nothing(model):
    eng = Engine(model, prefix_cache=True, **SMALL)
    eng.update_weights(None, 5)
    for bad, match in ((2, "not newer than the engine's version 5"), (5, "not newer"), (True, "expected an int"),
                       (6.0, "expected an int")):
        with pytest.raises(ValueError, match=match):
            eng.update_weights(None, bad)
    assert eng.version == 5
    own = model.state_dict()
    before = {k: v.clone() for k, v in own.items()}
    first, second = list(own)[:2]
    for sd, match in (({first: own[first] + 1, second: torch.zeros(3)}, f"{second} has shape"),
                      ({first: own[first] + 1, second: own[second] * math.nan}, f"{second} has non-finite"),
                      ({first: own[first] + 1, second: own[second].tolist()}, f"{second} is a list")):
        with pytest.raises(ValueError, match=match):
            eng.update_weights(sd, 6)
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())   # nothing half-applied
        assert eng.version == 5


def test_engine_options_are_checked(model):
    with pytest.raises(ValueError, match="page_size: expected an integer, got float"):
        Engine(model, page_size=2.5)
    with pytest.raises(ValueError, match="prefix_match: must be one of"):
        Engine(model, prefix_match="fuzzy")
    with pytest.raises(TypeError, match="unknown option 'pagesize'"):
        Engine(model, pagesize=8)
    with pytest.raises(ValueError, match="version"):
        Engine(model, version=-1)
