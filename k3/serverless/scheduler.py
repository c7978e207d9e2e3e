"""The service's scheduler: one worker thread runs every model computation; requests queue per session.

Each round takes the kind (forward_backward, forward, optim_step, sample, ...) of the oldest waiting request (a
one-a-round kind may go before an older batched one for a bounded number of rounds, `_lead`) and batches the head
requests of that kind of as many sessions as fit (`max_batch_rows` rows), one request per session (a session's own
requests run in order), except for the read-only kinds (sample, logprobs), where a session's consecutive queued
requests of the kind join the round too. Who goes first in a full round trades adapter locality against
fairness: sessions whose optimizer state is resident go before offloaded ones, but a session passed over
`max_skips` times goes first; among equals the session that has been served the fewest rows goes first (a deficit
order, which keeps Jain's fairness index near 1 under equal demand). Sessions not scheduled for `offload_after`
rounds have their optimizer state offloaded to host memory; a queued request for an offloaded session starts its
asynchronous staging back at once, so the copy overlaps the rounds before it runs.

With `batch_wait_s` > 0 a batched round waits up to that long (from its oldest request or the end of the round
before, whichever is later) for more sessions' requests of its kind, but only for sessions served recently
(`RECENT_S`) that can still send one (`_gather`): sessions in a closed loop of calls (sample turn, answer, next
turn) then meet in one round instead of taking turns; a lone session never waits."""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

BATCHED = ("forward_backward", "forward", "sample", "logprobs")
# kinds that read a snapshot and change no session state: a session's consecutive requests of one of them may
# share a round (its sample calls of one turn, issued together, become one engine batch)
READ_ONLY = ("sample", "logprobs")
RECENT_S = 0.25   # a session served this recently is expected to send its next request soon (batch_wait_s)


@dataclass
class Request:
    kind: str
    session: str               # the session the request is billed to (a sampler's owner for sampling)
    payload: Any
    rows: int = 1
    future: Future = field(default_factory=Future)
    seq: int = 0
    submitted: float = 0.0


class Scheduler:
    def __init__(self, execute: Callable[[str, list[Request]], None], *, max_batch_rows: int, offload_after: int,
                 max_skips: int, batch_wait_s: float = 0.0, is_resident: Callable[[str], bool] = lambda s: True,
                 stage: Callable[[str], None] = lambda s: None, offload: Callable[[str], None] = lambda s: None
                 ) -> None:
        self.execute, self.max_rows = execute, max_batch_rows
        self.offload_after, self.max_skips, self.batch_wait_s = offload_after, max_skips, batch_wait_s
        self.last_done: dict[str, float] = {}
        self.is_resident, self.stage, self.offload = is_resident, stage, offload
        self.queues: dict[str, deque[Request]] = {}
        self.served_rows: dict[str, int] = {}
        self.skips: dict[str, int] = {}
        self.last_round: dict[str, int] = {}
        self.round = 0
        self.batches: list[tuple[str, int, int]] = []   # (kind, sessions, rows) per round, for tests and benchmarks
        # per kind: rounds, sessions and rows served, seconds the worker spent on them (the service's /stats)
        self.by_kind: dict[str, dict[str, float]] = {}
        self._seq = itertools.count()
        self._free_since = 0.0   # when the worker finished its last round
        self._singles_ahead = 0  # one-a-round rounds run in a row ahead of an older batched request (_lead)
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="k3-serverless-scheduler", daemon=True)
        self._thread.start()

    def submit(self, kind: str, session: str, payload: Any, rows: int = 1) -> Future:
        req = Request(kind, session, payload, rows, seq=next(self._seq), submitted=time.perf_counter())
        with self._cv:
            if self._stop:
                raise RuntimeError("the scheduler is stopped")
            self.queues.setdefault(session, deque()).append(req)
            self._cv.notify()
        if not self.is_resident(session):
            self.stage(session)
        return req.future

    def counters(self) -> dict:
        """A consistent copy of the per-kind tallies, the served rows and the round count (for /v1/stats)."""
        with self._cv:
            return {"rounds_by_kind": {k: dict(v) for k, v in self.by_kind.items()},
                    "served_rows": dict(self.served_rows), "rounds": self.round}

    def forget(self, session: str) -> None:
        with self._cv:
            for d in (self.served_rows, self.skips, self.last_round, self.last_done):
                d.pop(session, None)

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=30)

    # ------------------------------------------------------------------ policy
    def _lead(self, heads: list[Request]) -> Request:
        """The request whose kind the next round takes: the oldest head, except that a one-a-round head (optim_step,
        save_sampler, ...) goes before an older batched one, for at most as many rounds in a row as there are
        waiting sessions plus `max_skips`. A session behind the others in a closed loop of calls then catches up
        on its cheap calls and joins the batched round, instead of staying one round behind for good."""
        oldest = min(heads, key=lambda r: r.seq)
        if oldest.kind in BATCHED and self._singles_ahead < len(heads) + self.max_skips:
            singles = [r for r in heads if r.kind not in BATCHED]
            if singles:
                return min(singles, key=lambda r: r.seq)
        return oldest

    def pick(self) -> tuple[str, list[Request]]:
        """The next round's kind and requests (called with the lock held, at least one request queued)."""
        heads = [q[0] for q in self.queues.values() if q]
        oldest = min(heads, key=lambda r: r.seq)
        lead = self._lead(heads)
        self._singles_ahead = self._singles_ahead + 1 if lead is not oldest else 0
        kind = lead.kind
        cands = [r for r in heads if r.kind == kind]
        if kind not in BATCHED:
            cands = [lead]

        def order(r: Request):
            starving = self.skips.get(r.session, 0) >= self.max_skips
            return (not starving, not self.is_resident(r.session), self.served_rows.get(r.session, 0), r.seq)

        cands.sort(key=order)
        chosen, rows = [], 0
        for r in cands:
            if chosen and rows + r.rows > self.max_rows:
                self.skips[r.session] = self.skips.get(r.session, 0) + 1
                continue
            chosen.append(r)
            rows += r.rows
        for r in list(chosen):
            q = self.queues[r.session]
            q.popleft()
            self.skips[r.session] = 0
            self.last_round[r.session] = self.round
            if kind in READ_ONLY:   # the session's next requests of this kind too, while they come in a run
                while q and q[0].kind == kind and rows + q[0].rows <= self.max_rows:
                    chosen.append(q.popleft())
                    rows += chosen[-1].rows
        for r in chosen:
            self.served_rows[r.session] = self.served_rows.get(r.session, 0) + r.rows
        chosen.sort(key=lambda r: r.seq)
        return kind, chosen

    def _gather(self) -> None:
        """Wait (lock held, releasing it while waiting) for more requests of the next round's kind; see module doc."""
        while not self._stop:
            heads = [q[0] for q in self.queues.values() if q]
            lead = self._lead(heads)
            if lead.kind not in BATCHED:
                return
            oldest = min((r for r in heads if r.kind == lead.kind), key=lambda r: r.seq)
            now = time.perf_counter()
            recent = {s for s, t in self.last_done.items() if now - t < RECENT_S}
            # who may still send a request for this round: a recent session with nothing queued (one queued on
            # another kind cannot before that runs) and, for read-only kinds with other sessions about, one whose
            # queued calls are this kind (its next call of the turn, e.g. a second task's sample, joins it)
            here = {r.session for r in heads if r.kind == lead.kind}
            expected = {s for s in recent if not self.queues.get(s)}
            if lead.kind in READ_ONLY and len(recent | here) > 1:
                expected |= {s for s in recent & here if all(r.kind == lead.kind for r in self.queues[s])}
            if not expected:
                return
            # from when the worker could start the round: sessions that come out of a run of one-a-round calls
            # (optim_step, save_sampler) one after another send their next batched call only as their turn ends
            left = max(oldest.submitted, self._free_since) + self.batch_wait_s - now
            if left <= 0:
                return
            self._cv.wait(left)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not any(self.queues.values()):
                    self._cv.wait()
                if self._stop:
                    pending = [r for q in self.queues.values() for r in q]
                    self.queues.clear()
                    break
                if self.batch_wait_s > 0:
                    self._gather()
                kind, batch = self.pick()
                self.round += 1
                idle = [s for s, r in self.last_round.items()
                        if self.round - r > self.offload_after and not self.queues.get(s)]
            self.batches.append((kind, len(batch), sum(r.rows for r in batch)))
            started = time.perf_counter()
            try:
                self.execute(kind, batch)
            except BaseException as e:  # execute sets per-request results; anything left gets the error
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(e)
            for r in batch:
                if not r.future.done():
                    r.future.set_exception(RuntimeError(f"{kind}: no result was produced"))
            done = time.perf_counter()
            with self._cv:
                for r in batch:
                    self.last_done[r.session] = done
                tally = self.by_kind.setdefault(kind, {"rounds": 0, "sessions": 0, "rows": 0, "seconds": 0.0})
                tally["rounds"] += 1
                tally["sessions"] += len({r.session for r in batch})
                tally["rows"] += sum(r.rows for r in batch)
                tally["seconds"] += done - started
                self._free_since = done
            for s in idle:
                if self.is_resident(s):
                    self.offload(s)
        for r in pending:
            r.future.set_exception(RuntimeError("the server is shutting down"))
