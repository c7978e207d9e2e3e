"""benchmarks/prefix_cache.py's equal-memory replay: under a state budget no policy holds more states than the
budget, eviction happens, and the replay is deterministic (no GPU, no model)."""
import pytest

from benchmarks.prefix_cache import POLICIES, equal_memory, make_trace, replay


@pytest.fixture(scope="module")
def trace():
    return make_trace(5, system=300, tasks=2, G=3, turns=3, task_len=(20, 80), gen_len=(40, 300), tool_len=(5, 40))


def test_budget_caps_states_and_is_deterministic(trace):
    unlimited = replay(trace)
    peak = unlimited["sglang_like"]["states_held_peak"]
    assert unlimited["ours"]["states_held_peak"] > peak  # ours checkpoints more: the comparison is worth making
    budget = max(1, peak // 2)
    a, b = replay(trace, budget), replay(trace, budget)
    assert a == b
    assert set(a) == {cls.name for cls in POLICIES}
    for name, v in a.items():
        assert v["states_held_peak"] <= budget, name
        assert v["state_budget"] == budget
        assert v["prompt_token_hit_rate"] <= unlimited[name]["prompt_token_hit_rate"] + 1e-12, name
        hit = round(v["prompt_token_hit_rate"] * v["prompt_tokens"])
        assert v["computed_prompt_tokens"] == v["prompt_tokens"] - hit, name
    assert a["ours"]["states_evicted"] > 0


def test_equal_memory_budgets_follow_the_sglang_like_peak(trace):
    unlimited = replay(trace)
    res = equal_memory(trace, unlimited, fractions=(1.0, 0.25))
    peak = unlimited["sglang_like"]["states_held_peak"]
    assert [r["budget_states"] for r in res["runs"]] == [peak, max(1, round(peak * 0.25))]
    for run in res["runs"]:
        assert all(v["states_held_peak"] <= run["budget_states"] for v in run["policies"].values())
    # at the SGLang-like policy's own unlimited peak it evicts nothing and keeps its unlimited figures
    same = res["runs"][0]["policies"]["sglang_like"]
    assert same["states_evicted"] == 0
    assert same["prompt_token_hit_rate"] == unlimited["sglang_like"]["prompt_token_hit_rate"]
