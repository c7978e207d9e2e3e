"""DP prefill pairing through SGLang's own extension point: the AROUND hook on `PrefillDelayer`'s decision, applied
by SGLang's HookRegistry, runs SGLang's rule unchanged unless SGLANG_K3_DP_PAIRING=1, and then gives exactly the
k3 rule's decisions from SGLang's all-gathered table, with output reasons SGLang's recorder accepts.
A server's `PrefillDelayer.__init__` needs the TP group; `make_delayer` sets its attributes without it (see there)."""
import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.managers import prefill_delayer as pd  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402

from k3.rollout.dp_pairing import (PairingConfig, PairingState, RankCounts, SimConfig, bounded_pairing_policy,  # noqa
                                   decide, rl_trace, simulate)
from k3_sglang import dp_pairing  # noqa: E402


@pytest.fixture(scope="module")
def hooked():
    if dp_pairing.TARGET not in HookRegistry._hooks or not any(
            h is dp_pairing.negotiate_bounded for _, h, _ in HookRegistry._hooks[dp_pairing.TARGET]):
        dp_pairing.register()
    HookRegistry.apply_hooks()
    fn = pd.PrefillDelayer.__dict__["_negotiate_should_allow_prefill_pure"]
    assert hasattr(fn, "__wrapped__"), "the AROUND hook was not applied to PrefillDelayer's decision"
    return fn


def _call(delayer, table, prev, local, running, waiting):
    delayer._gather_info = lambda **_: table
    return delayer._negotiate_should_allow_prefill_pure(prev, local, 0.5, running_batch=running, max_prefill_bs=4,
                                                         max_running_requests=64, waiting_queue_len=waiting)


def _table(rows):
    return torch.tensor(rows, dtype=torch.int64)


def test_without_flag_sglang_rule_unchanged(hooked, monkeypatch):
    monkeypatch.delenv(dp_pairing.ENV, raising=False)
    original = hooked.__wrapped__
    table = _table([[1, 0, 3, 4, 2, 0], [0, 0, 0, 0, 0, 0], [1, 0, 60, 4, 5, 0]])
    for prev in (None, pd._State(delayed_count=3)):
        a = dp_pairing.make_delayer(8, 3)
        b = dp_pairing.make_delayer(8, 3)
        got = _call(a, table, prev, True, 3, 2)
        b._gather_info = lambda **_: table
        want = original(b, prev, True, 0.5, running_batch=3, max_prefill_bs=4, max_running_requests=64,
                        waiting_queue_len=2)
        assert (got.output_allow, got.output_reason, got.next_state and got.next_state.delayed_count) == \
            (want.output_allow, want.output_reason, want.next_state and want.next_state.delayed_count)


def test_with_flag_decisions_are_the_k3_rule(hooked, monkeypatch):
    monkeypatch.setenv(dp_pairing.ENV, "1")
    import random
    rnd = random.Random(0)
    for _ in range(300):
        rows = [[int(w > 0), 0, r, 4, w, 0] for w, r in ((rnd.choice([0, 0, 2]), rnd.choice([0, 5])) for _ in range(4))]
        waited = rnd.randint(0, 6)
        prev = pd._State(delayed_count=waited) if waited else None
        d = dp_pairing.make_delayer(6, 4)
        out = _call(d, _table(rows), prev, bool(rows[0][0]), rows[0][2], rows[0][4])
        want = decide([RankCounts(r[4], r[2]) for r in rows], PairingState(waited), PairingConfig(5))  # 6 - 1
        assert out.output_allow == want.allow
        assert (out.next_state.delayed_count if out.next_state else 0) == want.next_state.waited
        pd._record_single_pass_result(actual_execution=out.output_allow, output=out, metrics_collector=None,
                                      debug_log_enabled=True)   # SGLang asserts the reason is one it knows


def test_bad_flag_named(hooked, monkeypatch):
    monkeypatch.setenv(dp_pairing.ENV, "yes")
    with pytest.raises(ValueError, match=dp_pairing.ENV):
        _call(dp_pairing.make_delayer(4, 2), _table([[1, 0, 0, 0, 1, 0]] * 2), None, True, 0, 1)
    monkeypatch.setenv(dp_pairing.ENV, "1")
    monkeypatch.setenv(dp_pairing.ENV_MIN_READY, "half")
    with pytest.raises(ValueError, match=dp_pairing.ENV_MIN_READY):
        _call(dp_pairing.make_delayer(4, 2), _table([[1, 0, 0, 0, 1, 0]] * 2), None, True, 0, 1)


@pytest.fixture(scope="module")
def trace():
    return rl_trace(0, 4, groups=6, group_size=4, turns=(1, 3), prompt=(300, 1500), gen=(10, 120), tool=(10, 80),
                    tool_wait=(1, 8), group_gap=20, idle_ranks=1)


def test_simulated_through_sglang_equals_k3_rule(trace):
    cfg = SimConfig(ranks=4, prefill_budget=2048, max_running=32)
    via_sglang = simulate(trace, cfg, dp_pairing.delayer_policy(5, cfg.max_running, ours=True)).summary()
    direct = simulate(trace, cfg, bounded_pairing_policy(PairingConfig(4))).summary()   # cap 5 - 1
    assert via_sglang == direct


def test_sglang_delayer_waits_for_idle_rank_ours_does_not(trace):
    """With one rank that never gets work, SGLang's 'mixed' branch delays every admission to its pass cap;
    ours does not wait for that rank (both bounded: the simulation drains)."""
    cfg = SimConfig(ranks=4, prefill_budget=2048, max_running=32)
    sgl = simulate(trace, cfg, dp_pairing.delayer_policy(8, cfg.max_running, ours=False)).summary()
    ours = simulate(trace, cfg, dp_pairing.delayer_policy(8, cfg.max_running, ours=True)).summary()
    assert sgl["admission_wait_max"] <= 7 and ours["admission_wait_max"] <= 7   # --max-delay-passes 8
    assert ours["admission_wait_mean"] < sgl["admission_wait_mean"]
