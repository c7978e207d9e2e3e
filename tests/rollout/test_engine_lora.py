"""Multi-LoRA serving: `adapter_id` selects each row's adapter (None = the base), prefill and mixed decode
batches alike; every row is bitwise what serving its adapter alone gives; cache entries are scoped by the adapter
applied; unknown ids are refused. Found by a user: `adapter_id` used to only label the cache (adapter "b"
requests got whatever adapter was activated, cached under "b")."""
import pytest
import torch

from k3.lora import LoRAConfig
from k3.rollout import Engine, SamplingParams

from _engine_helpers import SMALL, lora_served, rand_tokens, same


@pytest.fixture(scope="module")
def served():
    cfg = LoRAConfig(rank=4, alpha=8.0, targets=("attn", "mlp", "experts"), init_scale=0.05)
    model, lora = lora_served({"a": cfg, "b": cfg})
    yield model, lora
    lora.close()


ADAPTERS = ["a", None, "b", "a", "b", None]


def _requests(greedy: bool):
    prompts = [rand_tokens(11 + 3 * i, 60 + i) for i in range(len(ADAPTERS))]
    params = [SamplingParams(temperature=0.0 if greedy else 0.9, seed=70 + i, max_tokens=6, adapter_id=a)
              for i, a in enumerate(ADAPTERS)]
    return prompts, params


@pytest.mark.parametrize("greedy", [True, False])
def test_mixed_batch_rows_equal_each_adapter_served_alone(served, greedy):
    model, _ = served
    prompts, params = _requests(greedy)
    mixed = Engine(model, prefix_cache=True, **SMALL).generate(prompts, params)
    for name in ("a", "b", None):
        idx = [i for i, a in enumerate(ADAPTERS) if a == name]
        alone = Engine(model, prefix_cache=True, **SMALL).generate([prompts[i] for i in idx], [params[i] for i in idx])
        assert same([mixed[i] for i in idx], alone), name
        assert all(c.adapter_id == name for c in alone)
    # the adapters really are applied: the same prompt under a, b and the base gives three different results
    p = prompts[0]
    per = [Engine(model, prefix_cache=False, **SMALL).generate([p], SamplingParams(temperature=0.0, max_tokens=4,
                                                                                   adapter_id=a))[0].logprobs
           for a in ("a", "b", None)]
    assert per[0] != per[1] and per[0] != per[2] and per[1] != per[2]


def test_adapter_rows_match_the_reference_forward(served):
    model, lora = served
    p = rand_tokens(19, 80)
    for name in ("a", "b", None):
        c = Engine(model, prefix_cache=True, **SMALL).generate(
            [p], SamplingParams(temperature=0.0, max_tokens=5, adapter_id=name))[0]
        with torch.no_grad(), lora.use(name):
            logits = model(torch.tensor([p + c.token_ids]), use_cache=False).logits[0]
        logp = torch.log_softmax(logits.float(), -1)
        want = [float(logp[len(p) - 1 + i, t]) for i, t in enumerate(c.token_ids)]
        assert max(abs(x - y) for x, y in zip(c.logprobs, want)) < 1e-4, name


def test_a_global_activation_does_not_leak_into_base_requests(served):
    model, lora = served
    p = rand_tokens(15, 81)
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    base = Engine(model, prefix_cache=False, **SMALL).generate([p], sp)
    lora.activate("b")
    try:
        assert same(Engine(model, prefix_cache=False, **SMALL).generate([p], sp), base)
    finally:
        lora.activate(None)


def test_cache_is_scoped_by_the_adapter_applied(served):
    model, _ = served
    eng = Engine(model, prefix_cache=True, **SMALL)
    p = rand_tokens(33, 82)
    sp = {a: SamplingParams(temperature=0.0, max_tokens=3, adapter_id=a) for a in ("a", "b", None)}
    assert eng.generate([p], sp["a"])[0].hit_tokens == 0
    assert eng.generate([p], sp["b"])[0].hit_tokens == 0     # a's entries are not b's
    assert eng.generate([p], sp[None])[0].hit_tokens == 0
    assert eng.generate([p], sp["a"])[0].hit_tokens == 33
    assert {s[0] for s in eng.tree.roots} == {"a", "b", None}
    eng.adapter_updated("a")                                  # hot-loaded weights: a's entries are released
    assert {s[0] for s in eng.tree.roots} == {"b", None}
    assert eng.generate([p], sp["a"])[0].hit_tokens == 0
    assert eng.generate([p], sp["b"])[0].hit_tokens == 33
    eng.check()


def test_unknown_and_merged_adapters(served):
    model, lora = served
    eng = Engine(model, prefix_cache=True, **SMALL)
    with pytest.raises(ValueError, match=r"sampling\.adapter_id: unknown adapter 'c' \(loaded: \['a', 'b'\]\)"):
        eng.generate([[1, 2, 3]], SamplingParams(adapter_id="c"))
    lora.merge("a")
    try:
        with pytest.raises(ValueError, match="adapter 'a' is merged into the served weights"):
            eng.generate([[1, 2, 3]], SamplingParams(adapter_id=None))
        c = eng.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2, adapter_id="a"))[0]
        assert c.adapter_id == "a" and len(c.token_ids) == 2
    finally:
        lora.unmerge()
    assert eng.running == []
