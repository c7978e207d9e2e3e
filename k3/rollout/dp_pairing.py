"""Bounded-wait DP prefill pairing: when should data-parallel attention ranks run their prefills?

With DP attention every rank runs each forward pass together and the MoE/MLP exchange pads every rank's batch to
the largest one. A prefill on one rank while the others decode pads their few decode tokens up to the prefill's
thousands, and stalls the prefilling rank's own decodes for that pass. Running the ranks' prefills in the same pass
("pairing") wastes less, but waiting for a partner costs admission latency; waiting for a rank that will never have
work is a hang, and waiting without a cap starves admission.

The rule here decides from counts every rank contributes to one all-gather (so every rank sees the same numbers)
and from a wait counter that only changes through decisions (so every rank holds the same counter): the decision
is a pure function of identical inputs and is identical on every rank, with no rank-local timer. It

- admits when no rank has prefill work (nothing to wait for),
- admits when enough of the *active* ranks (ranks with queued or running requests) have prefill work; a rank with
  nothing queued and nothing running is not waited for, so one idle rank cannot stall the others,
- otherwise waits one forward pass, at most `max_wait_passes` passes in a row, then admits (hard cap).

So a prefill request waits at most `max_wait_passes` forward passes for pairing, whatever the other ranks do.
`simulate` replays a DP trace through any such policy and counts what pairing is about (padding tokens, decode
passes lost or stretched by prefills, admission waits); benchmarks/dp_pairing.py runs it on an RL trace.
"""
from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum


@dataclass(frozen=True)
class PairingConfig:
    max_wait_passes: int = 4          # hard cap on consecutive delayed passes
    min_ready_fraction: float = 1.0   # admit when this fraction of active ranks has prefill work

    def __post_init__(self):
        if not isinstance(self.max_wait_passes, int) or self.max_wait_passes < 0:
            raise ValueError(f"max_wait_passes: must be an int >= 0, got {self.max_wait_passes!r}")
        if not 0.0 < self.min_ready_fraction <= 1.0:
            raise ValueError(f"min_ready_fraction: must be in (0, 1], got {self.min_ready_fraction!r}")


@dataclass(frozen=True)
class RankCounts:
    """One rank's contribution to the all-gather."""
    waiting: int    # requests this rank could start prefilling now (0: nothing admissible)
    running: int    # requests decoding on this rank

    def __post_init__(self):
        if self.waiting < 0 or self.running < 0:
            raise ValueError(f"RankCounts: counts must be >= 0, got waiting={self.waiting} running={self.running}")


@dataclass(frozen=True)
class PairingState:
    waited: int = 0   # consecutive passes the pending prefills have been delayed


class Reason(Enum):
    NO_WORK = "no_work"       # no rank has prefill work
    PAIRED = "paired"         # enough active ranks have prefill work
    WAIT = "wait"             # delayed one pass
    CAP = "cap"               # delayed max_wait_passes already: admitted


@dataclass(frozen=True)
class Decision:
    allow: bool
    reason: Reason
    next_state: PairingState
    ready: int        # ranks with prefill work
    active: int       # ranks with any work


def decide(counts: Sequence[RankCounts], state: PairingState, cfg: PairingConfig) -> Decision:
    """The pairing decision for one forward pass from the all-gathered `counts` (one entry per rank)."""
    if not counts:
        raise ValueError("counts: need one RankCounts per rank, got none")
    ready = sum(c.waiting > 0 for c in counts)
    active = sum(c.waiting > 0 or c.running > 0 for c in counts)
    if ready == 0:
        return Decision(True, Reason.NO_WORK, PairingState(0), ready, active)
    if ready >= math.ceil(cfg.min_ready_fraction * active):
        return Decision(True, Reason.PAIRED, PairingState(0), ready, active)
    if state.waited >= cfg.max_wait_passes:
        return Decision(True, Reason.CAP, PairingState(0), ready, active)
    return Decision(False, Reason.WAIT, PairingState(state.waited + 1), ready, active)


class BoundedPairing:
    """`decide` with its state, one instance per rank (what a scheduler holds)."""

    def __init__(self, cfg: PairingConfig):
        self.cfg, self.state = cfg, PairingState()

    def __call__(self, counts: Sequence[RankCounts]) -> Decision:
        d = decide(counts, self.state, self.cfg)
        self.state = d.next_state
        return d


# ---------------------------------------------------------------------- simulator
@dataclass(frozen=True)
class SimConfig:
    ranks: int = 8
    prefill_budget: int = 8192       # prefill tokens one rank computes per pass (chunked prefill)
    max_running: int = 64            # decoding requests per rank


@dataclass
class Turn:
    prefill: int        # tokens this turn prefills (prompt, or tool output on a resume with the prefix cached)
    decode: int         # tokens it generates (>= 1; the first comes out of the prefill pass)
    then_wait: int      # passes until the next turn arrives (tool latency); unused on the last turn


@dataclass
class SimRequest:
    rank: int
    arrival: int
    turns: list[Turn]


@dataclass
class _Live:
    req: SimRequest
    turn: int
    arrived: int
    prefill_left: int
    decode_left: int


def rl_trace(seed: int, ranks: int, groups: int, group_size: int, turns: tuple[int, int], prompt: tuple[int, int],
             gen: tuple[int, int], tool: tuple[int, int], tool_wait: tuple[int, int], group_gap: int,
             idle_ranks: int = 0) -> list[SimRequest]:
    """Rollout groups arriving every `group_gap` passes, their samples spread round-robin over the ranks that take
    work (the last `idle_ranks` ranks get none), each sample a multi-turn episode whose later turns prefill only
    the tool output (the prefix cache holds the rest)."""
    if not 0 <= idle_ranks < ranks:
        raise ValueError(f"idle_ranks: need 0 <= idle_ranks < ranks, got {idle_ranks} of {ranks}")
    rnd = random.Random(seed)
    busy = ranks - idle_ranks
    out, k = [], 0
    for g in range(groups):
        p = rnd.randint(*prompt)
        for _ in range(group_size):
            n = rnd.randint(*turns)
            ts = [Turn(p if t == 0 else rnd.randint(*tool), rnd.randint(*gen), rnd.randint(*tool_wait))
                  for t in range(n)]
            out.append(SimRequest(k % busy, g * group_gap, ts))
            k += 1
    return out


@dataclass
class SimResult:
    passes: int = 0
    prefill_passes: int = 0                # passes in which some rank prefilled
    padding_tokens: int = 0                # sum over passes and ranks of (largest rank batch - this rank's batch)
    computed_tokens: int = 0
    decode_stalls: int = 0                 # request-passes a decoding request lost to its rank's prefill pass
    stretched_decode_passes: int = 0       # rank-passes that decoded inside a pass where another rank prefilled
    admission_waits: list[int] = field(default_factory=list)   # passes from a turn's arrival to its first prefill
    decisions_delayed: int = 0

    def summary(self) -> dict:
        w = sorted(self.admission_waits)
        pct = lambda q: w[min(len(w) - 1, int(q * len(w)))] if w else 0
        return {"passes": self.passes, "prefill_passes": self.prefill_passes, "padding_tokens": self.padding_tokens,
                "computed_tokens": self.computed_tokens,
                "padding_fraction": self.padding_tokens / max(1, self.padding_tokens + self.computed_tokens),
                "decode_stalls": self.decode_stalls, "stretched_decode_passes": self.stretched_decode_passes,
                "delayed_passes": self.decisions_delayed, "turns_admitted": len(w),
                "admission_wait_mean": sum(w) / max(1, len(w)), "admission_wait_p99": pct(0.99),
                "admission_wait_max": w[-1] if w else 0}


# A policy sees every rank's counts (the all-gather) and returns one allow flag per rank; a correct DP policy
# returns the same flag for all of them (simulate checks).
Policy = Callable[[Sequence[RankCounts], Sequence[bool]], Sequence[bool]]


def simulate(trace: Sequence[SimRequest], cfg: SimConfig, policy: Policy, max_passes: int = 1_000_000) -> SimResult:
    """Forward passes until every turn of every request is done. Per pass each rank either prefills (if the policy
    allows and it has queued work, or it is mid-way through a chunked prefill: that one always continues, as in
    SGLang) or decodes all its running requests one token. Raises RuntimeError if the trace does not drain within
    `max_passes` (a hang) or ranks get different decisions."""
    for r in trace:
        if not 0 <= r.rank < cfg.ranks:
            raise ValueError(f"trace: request on rank {r.rank}, SimConfig has {cfg.ranks} ranks")
    seq = itertools.count()
    pending = [(r.arrival, next(seq), r, 0) for r in trace]
    heapq.heapify(pending)
    queue: list[list[_Live]] = [[] for _ in range(cfg.ranks)]
    running: list[list[_Live]] = [[] for _ in range(cfg.ranks)]
    res = SimResult()
    p, remaining = 0, sum(len(r.turns) for r in trace)
    while remaining:
        if p >= max_passes:
            raise RuntimeError(f"simulate: {remaining} turns still pending after {max_passes} passes (hang)")
        while pending and pending[0][0] <= p:
            _, _, r, t = heapq.heappop(pending)
            queue[r.rank].append(_Live(r, t, p, r.turns[t].prefill, r.turns[t].decode))
        mid_chunk = [bool(q) and q[0].prefill_left < q[0].req.turns[q[0].turn].prefill for q in queue]
        counts = [RankCounts(len(q) if (q and len(running[k]) < cfg.max_running) or mid_chunk[k] else 0,
                             len(running[k])) for k, q in enumerate(queue)]
        allow = list(policy(counts, mid_chunk))
        if len(set(allow)) > 1:
            raise RuntimeError(f"simulate: ranks decided differently at pass {p}: {allow}")
        if not allow[0] and any(c.waiting for c in counts):
            res.decisions_delayed += 1
        tokens, prefilling = [0] * cfg.ranks, [False] * cfg.ranks
        for k in range(cfg.ranks):
            if counts[k].waiting and (allow[k] or mid_chunk[k]):
                prefilling[k] = True
                res.decode_stalls += len(running[k])
                budget = cfg.prefill_budget
                while queue[k] and budget and len(running[k]) < cfg.max_running:
                    lv = queue[k][0]
                    if lv.prefill_left == lv.req.turns[lv.turn].prefill:
                        res.admission_waits.append(p - lv.arrived)
                    take = min(budget, lv.prefill_left)
                    lv.prefill_left -= take
                    budget -= take
                    tokens[k] += take
                    if lv.prefill_left == 0:
                        queue[k].pop(0)
                        lv.decode_left -= 1           # the prefill pass samples the first token
                        running[k].append(lv)
            else:
                tokens[k] = len(running[k])
                for lv in running[k]:
                    lv.decode_left -= 1
            done = [lv for lv in running[k] if lv.decode_left <= 0]
            running[k] = [lv for lv in running[k] if lv.decode_left > 0]
            for lv in done:
                remaining -= 1
                if lv.turn + 1 < len(lv.req.turns):
                    heapq.heappush(pending, (p + 1 + lv.req.turns[lv.turn].then_wait, next(seq), lv.req, lv.turn + 1))
        peak = max(tokens)
        res.padding_tokens += sum(peak - t for t in tokens)
        res.computed_tokens += sum(tokens)
        if any(prefilling):
            res.prefill_passes += 1
            res.stretched_decode_passes += sum(1 for k in range(cfg.ranks) if not prefilling[k] and tokens[k])
        p += 1
    res.passes = p
    return res


def no_pairing(counts: Sequence[RankCounts], mid_chunk: Sequence[bool]) -> list[bool]:
    return [True] * len(counts)


def bounded_pairing_policy(cfg: PairingConfig) -> Policy:
    """One `BoundedPairing` per rank, each fed the same all-gathered counts (what every rank's scheduler does)."""
    per_rank: list[BoundedPairing] = []

    def policy(counts: Sequence[RankCounts], mid_chunk: Sequence[bool]) -> list[bool]:
        while len(per_rank) < len(counts):
            per_rank.append(BoundedPairing(cfg))
        return [rank(counts).allow for rank in per_rank[:len(counts)]]
    return policy
