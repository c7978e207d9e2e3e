"""The DP prefill pairing rule's invariants (k3.rollout.dp_pairing): bounded delay, the same decision on every rank,
no hang with an idle rank, no starved admission; and the simulator's own checks (it must catch a hang and ranks
that disagree, or its figures mean nothing)."""
import random

import pytest

from k3.rollout.dp_pairing import (BoundedPairing, PairingConfig, PairingState, RankCounts, Reason, SimConfig,
                                   SimRequest, Turn, bounded_pairing_policy, decide, no_pairing, rl_trace, simulate)


def random_counts(rnd: random.Random, ranks: int) -> list[RankCounts]:
    return [RankCounts(rnd.choice([0, 0, 1, 3]), rnd.choice([0, 2, 8])) for _ in range(ranks)]


@pytest.mark.parametrize("cap", [0, 1, 4, 30])
def test_delay_never_exceeds_cap(cap):
    rnd = random.Random(cap)
    pol = BoundedPairing(PairingConfig(max_wait_passes=cap))
    streak = 0
    for _ in range(5000):
        d = pol(random_counts(rnd, 8))
        streak = streak + 1 if not d.allow else 0
        assert streak <= cap
        assert d.reason is not Reason.CAP or streak == 0


def test_every_rank_decides_the_same():
    """Ranks hold separate state; fed the same all-gathered counts they never disagree (no rank-local input)."""
    rnd = random.Random(1)
    ranks = [BoundedPairing(PairingConfig(3, 0.75)) for _ in range(8)]
    for _ in range(3000):
        counts = random_counts(rnd, 8)
        decisions = {(d.allow, d.reason, d.next_state) for d in (r(counts) for r in ranks)}
        assert len(decisions) == 1


def test_idle_rank_is_not_waited_for():
    """One rank with work, seven with nothing queued or running: admitted at once (waiting would be a hang
    without the cap, and a pointless delay with it)."""
    counts = [RankCounts(2, 0)] + [RankCounts(0, 0)] * 7
    d = decide(counts, PairingState(), PairingConfig(max_wait_passes=30))
    assert d.allow and d.reason is Reason.PAIRED and d.active == 1
    tr = [SimRequest(0, 0, [Turn(100, 5, 0)])]
    res = simulate(tr, SimConfig(ranks=8), bounded_pairing_policy(PairingConfig(30)))
    assert res.admission_waits == [0] and res.decisions_delayed == 0


def test_busy_partner_waits_then_cap_admits():
    counts = [RankCounts(1, 0), RankCounts(0, 4)]
    cfg = PairingConfig(max_wait_passes=2)
    s = PairingState()
    seen = []
    for _ in range(3):
        d = decide(counts, s, cfg)
        seen.append(d.reason)
        s = d.next_state
    assert seen == [Reason.WAIT, Reason.WAIT, Reason.CAP] and s.waited == 0


def test_simulated_admission_bounded_and_drains():
    """On an RL trace with an idle rank: everything drains, and no turn waits longer than the cap (the trace does
    not fill max_running, so only the pairing decision can delay admission)."""
    tr = rl_trace(3, 4, groups=6, group_size=4, turns=(1, 3), prompt=(200, 900), gen=(5, 60), tool=(10, 50),
                  tool_wait=(1, 6), group_gap=15, idle_ranks=1)
    for cap in (0, 3, 6):
        res = simulate(tr, SimConfig(ranks=4, prefill_budget=1024, max_running=256),
                       bounded_pairing_policy(PairingConfig(cap)))
        assert len(res.admission_waits) == sum(len(r.turns) for r in tr)
        assert max(res.admission_waits) <= cap
    base = simulate(tr, SimConfig(ranks=4, prefill_budget=1024, max_running=256), no_pairing)
    assert max(base.admission_waits) == 0


def test_simulator_detects_hang_and_disagreement():
    tr = [SimRequest(0, 0, [Turn(10, 2, 0)]), SimRequest(1, 0, [Turn(10, 2, 0)])]
    never = lambda counts, mid: [False] * len(counts)
    with pytest.raises(RuntimeError, match="hang"):
        simulate(tr, SimConfig(ranks=2), never, max_passes=50)
    split = lambda counts, mid: [k == 0 for k in range(len(counts))]
    with pytest.raises(RuntimeError, match="differently"):
        simulate(tr, SimConfig(ranks=2), split)


def test_deterministic():
    tr = rl_trace(5, 4, groups=4, group_size=4, turns=(1, 3), prompt=(100, 500), gen=(3, 30), tool=(5, 40),
                  tool_wait=(1, 5), group_gap=10)
    a = simulate(tr, SimConfig(ranks=4), bounded_pairing_policy(PairingConfig(4))).summary()
    b = simulate(tr, SimConfig(ranks=4), bounded_pairing_policy(PairingConfig(4))).summary()
    assert a == b


def test_bad_input_named():
    with pytest.raises(ValueError, match="max_wait_passes"):
        PairingConfig(max_wait_passes=-1)
    with pytest.raises(ValueError, match="min_ready_fraction"):
        PairingConfig(min_ready_fraction=0.0)
    with pytest.raises(ValueError, match="RankCounts"):
        RankCounts(-1, 0)
    with pytest.raises(ValueError, match="counts"):
        decide([], PairingState(), PairingConfig())
    with pytest.raises(ValueError, match="rank 5"):
        simulate([SimRequest(5, 0, [Turn(1, 1, 0)])], SimConfig(ranks=2), no_pairing)
    with pytest.raises(ValueError, match="idle_ranks"):
        rl_trace(0, 2, 1, 1, (1, 1), (1, 1), (1, 1), (1, 1), (1, 1), 1, idle_ranks=2)
