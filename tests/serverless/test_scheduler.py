"""Scheduler policy (no model): batching of compatible heads, per-session order, fairness by served rows,
locality (resident first) bounded by max_skips, offload of idle sessions and staging on submit."""
import threading
import time

from k3.serverless.scheduler import Scheduler


class Recorder:
    def __init__(self, gate: threading.Event | None = None):
        self.rounds: list[tuple[str, list[tuple[str, object]]]] = []
        self.gate = gate

    def __call__(self, kind, batch):
        if self.gate is not None:
            self.gate.wait()
        self.rounds.append((kind, [(r.session, r.payload) for r in batch]))
        for r in batch:
            r.future.set_result(r.payload)


def _blocked(**kw):
    """A scheduler whose first round waits on a gate, so that everything submitted meanwhile queues up."""
    gate = threading.Event()
    rec = Recorder(gate)
    s = Scheduler(rec, **{"max_batch_rows": 100, "offload_after": 1000, "max_skips": 2, **kw})
    first = s.submit("optim_step", "warmup", 0)
    time.sleep(0.05)
    return s, rec, gate, first


def test_batches_heads_of_one_kind_and_keeps_each_sessions_order():
    s, rec, gate, first = _blocked()
    futs = [s.submit("forward_backward", "a", 1), s.submit("optim_step", "a", 2), s.submit("forward_backward", "b", 3),
            s.submit("forward_backward", "c", 4), s.submit("optim_step", "b", 5)]
    gate.set()
    assert [f.result(timeout=10) for f in futs] == [1, 2, 3, 4, 5]
    s.close()
    kinds = [(k, sorted(x[0] for x in b)) for k, b in rec.rounds[1:]]
    assert kinds[0] == ("forward_backward", ["a", "b", "c"])   # one request per session, heads of one kind
    assert [k for k, _ in kinds[1:]] == ["optim_step", "optim_step"]


def test_fairness_and_row_limit():
    s, rec, gate, first = _blocked(max_batch_rows=4)
    s.served_rows.update({"a": 10, "b": 0, "c": 5})
    futs = [s.submit("forward_backward", n, n, rows=3) for n in ("a", "b", "c")]
    gate.set()
    for f in futs:
        f.result(timeout=10)
    s.close()
    order = [b[0][0] for k, b in rec.rounds[1:]]
    assert order == ["b", "c", "a"]     # least served first; 3 + 3 rows exceed the limit: one session a round


def test_locality_yields_to_a_starving_session():
    resident = {"a": True, "b": True, "cold": False}
    staged = []
    s, rec, gate, first = _blocked(max_batch_rows=1, max_skips=2, is_resident=lambda n: resident.get(n, True),
                                   stage=staged.append)
    futs = [s.submit("forward_backward", "cold", 0)]
    assert staged == ["cold"]            # staging starts at submit
    for i in range(3):
        futs += [s.submit("forward_backward", "a", i), s.submit("forward_backward", "b", i)]
    gate.set()
    for f in futs:
        f.result(timeout=10)
    s.close()
    order = [b[0][0] for k, b in rec.rounds[1:]]
    assert order.index("cold") == 2      # passed over twice (locality), then first (max_skips)


def test_idle_sessions_are_offloaded():
    offloaded = []
    s = Scheduler(Recorder(), max_batch_rows=10, offload_after=2, max_skips=2, offload=offloaded.append)
    s.submit("forward", "idle", 0).result(timeout=10)
    for i in range(4):
        s.submit("forward", "busy", i).result(timeout=10)
    s.close()
    assert "idle" in offloaded and "busy" not in offloaded


def test_batch_wait_gathers_sessions_in_a_closed_loop_and_a_lone_session_never_waits():
    """Two sessions alternating sample calls meet in one round when batch_wait is set; one session alone is not
    delayed (its rounds start at once)."""
    rec = Recorder()
    s = Scheduler(rec, max_batch_rows=100, offload_after=1000, max_skips=2, batch_wait_s=0.2)
    t0 = time.perf_counter()
    for i in range(3):
        s.submit("sample", "solo", i).result(timeout=10)
    assert time.perf_counter() - t0 < 0.15          # no other session active: no waiting
    s.submit("sample", "a", 0).result(timeout=10)   # 'a' and 'solo' are now recent
    fa = s.submit("sample", "a", 1)
    time.sleep(0.05)
    fb = s.submit("sample", "solo", 9)
    assert fa.result(timeout=10) == 1 and fb.result(timeout=10) == 9
    s.close()
    assert rec.rounds[-1][0] == "sample" and sorted(x[0] for x in rec.rounds[-1][1]) == ["a", "solo"]


def test_a_sessions_consecutive_sample_calls_share_a_round():
    """Read-only calls (sample) queued one after another by one session join one round; a forward_backward
    behind them waits for its own round (a session's state-changing calls stay one a round, in order)."""
    s, rec, gate, first = _blocked()
    futs = [s.submit("sample", "a", i) for i in range(3)] + [s.submit("forward_backward", "a", 3),
                                                             s.submit("sample", "a", 4), s.submit("sample", "b", 5)]
    gate.set()
    assert [f.result(timeout=10) for f in futs] == [0, 1, 2, 3, 4, 5]
    s.close()
    rounds = [(k, [x[1] for x in b]) for k, b in rec.rounds[1:]]
    assert rounds == [("sample", [0, 1, 2, 5]), ("forward_backward", [3]), ("sample", [4])]


def test_sessions_in_a_closed_loop_stay_in_step():
    """Clients cycling forward_backward -> optim_step -> save_sampler -> sample (the load test's loop), with jitter
    between their calls shorter than batch_wait: the batched kinds must meet in about one round per cycle (the
    load test's throughput over one-after-another comes from these merged rounds)."""
    import random

    def execute(kind, batch):
        time.sleep(0.004 * (3 if kind in ("forward_backward", "sample") else 1))
        for r in batch:
            r.future.set_result(None)

    # batch_wait well above the jitter, so that a loaded machine's thread scheduling does not split rounds
    s = Scheduler(execute, max_batch_rows=100, offload_after=1000, max_skips=2, batch_wait_s=0.1)

    def client(name, seed):
        rng = random.Random(seed)
        for _ in range(6):
            for kind in ("forward_backward", "optim_step", "save_sampler", "sample"):
                time.sleep(rng.uniform(0, 0.003))    # the client's own work between calls
                s.submit(kind, name, None).result(timeout=30)

    threads = [threading.Thread(target=client, args=(f"c{i}", i)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s.close()
    for kind in ("forward_backward", "sample"):
        rounds = [n for k, n, _ in s.batches if k == kind]
        assert sum(rounds) == 24 and len(rounds) <= 10, (kind, rounds)   # 6 cycles x 4 sessions in ~6 rounds
