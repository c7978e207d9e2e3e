"""Token-keyed prefix matching (`prefix_match="tokens"`) for clients that re-send each conversation as a flat token
list: the history is reused from the cache, the decode-produced turn-end states included, where exact (key)
matching only reuses what was computed with the same segments. The price is rounding: measured here against
recomputation (and in benchmarks/prefix_match.py)."""
import pytest

from k3.rollout import Engine

from _engine_helpers import SMALL, TINY_POOLS, flat_conversations, same, workload


def _hit_rate(eng: Engine) -> float:
    return eng.cache_stats()["hit_rate"]


def test_flat_history_reuses_the_turn_end_states(model):
    exact = Engine(model, prefix_cache=True, **SMALL)
    tokens = Engine(model, prefix_cache=True, prefix_match="tokens", **SMALL)
    flat_conversations(exact)
    out_tokens = flat_conversations(tokens)
    for t in range(1, len(out_tokens)):
        for prev, now in zip(out_tokens[t - 1], out_tokens[t]):
            # everything the previous turn fed to the model: its prompt and all generated tokens but the last
            assert now.hit_tokens == len(prev.prompt) + len(prev.token_ids) - 1
    assert _hit_rate(tokens) > _hit_rate(exact) + 0.2
    exact.check()
    tokens.check()


def test_token_matching_costs_only_rounding_against_recomputation(model):
    ref = flat_conversations(Engine(model, prefix_cache=False, **SMALL))
    got = flat_conversations(Engine(model, prefix_cache=True, prefix_match="tokens", **SMALL))
    worst = 0.0
    for turn_ref, turn_got in zip(ref, got):
        for a, b in zip(turn_ref, turn_got):
            assert a.token_ids == b.token_ids
            worst = max(worst, max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)))
    # decode-computed history is not bitwise a long prefill of it (the documented price, <= rounding); with this
    # workload's 16-token prefill chunks every op computes a token as decode does (CPU: row-block GEMMs, MLA query
    # by query up to ops.PER_QUERY_MAX_TOKENS, the recurrent KDA path), so the price is 0 here
    assert worst < 1e-4


def test_span_prompts_are_served_bitwise_as_in_exact_mode(model):
    """Prompts built with Completion.extend carry their spans: token matching finds the same states."""
    exact = workload(Engine(model, prefix_cache=True, **SMALL), greedy=False)
    eng = Engine(model, prefix_cache=True, prefix_match="tokens", **SMALL)
    eng.check_each_step = True
    assert same(workload(eng, greedy=False), exact)


def test_token_matching_under_spills_and_evictions(model):
    eng = Engine(model, prefix_cache=True, prefix_match="tokens", **TINY_POOLS, **SMALL)
    eng.check_each_step = True
    flat_conversations(eng)
    st = eng.cache_stats()
    assert st["hit_tokens"] > 0 and st["kda_states_spills"] > 0 and st["tree_state_drops"] > 0


@pytest.mark.parametrize("match", ["exact", "tokens"])
def test_requests_of_one_call_share_their_common_prefix(model, match):
    """Admitted together, chats sharing a system prompt used to compute it once each: the later ones now wait for
    the first one's checkpoint at the last segment end inside the shared part (40 tokens, chunks of 16 -> 32)."""
    eng = Engine(model, prefix_cache=True, prefix_match=match, **SMALL)
    first_turn = flat_conversations(eng, turns=1)[0]
    assert [c.hit_tokens for c in first_turn] == [0, 32, 32]
    off = flat_conversations(Engine(model, prefix_cache=False, **SMALL), turns=1)[0]
    assert same(first_turn, off)
