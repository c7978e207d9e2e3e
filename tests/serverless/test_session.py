"""A session's optimizer state: offload to host and (asynchronous) staging back leave the next steps bitwise
unchanged; a refused step (non-finite gradient) changes nothing; state round-trips through its tensors."""
import pytest
import torch

from k3.lora import LoRAAdapter, LoRAConfig, Target
from k3.serverless.session import Session
from k3.serverless.types import AdamParams, ServiceError

ADAM = AdamParams(learning_rate=1e-2, weight_decay=0.1)


def _session(seed=0):
    ad = LoRAAdapter(LoRAConfig(rank=2, alpha=4.0, init_scale=0.1), {"w": Target("w", "linear", 6, 5)}, seed=seed)
    return Session("s", "h", ad, seed, torch.device("cpu"))


def _grad(s, i):
    g = torch.Generator().manual_seed(i)
    for p in s.params:
        p.grad = torch.randn(p.shape, generator=g)
    s.pending = 1


def _run(offload_every: int | None):
    s = _session()
    for i in range(6):
        _grad(s, i)
        s.optim_step(ADAM)
        if offload_every and i % offload_every == 0:
            s.offload()
            assert not s.resident
            if i % 2:
                s.stage()          # asynchronous staging; optim_step waits for it
    return s


def test_offload_and_staging_leave_steps_bitwise_unchanged():
    a, b = _run(None), _run(1)
    assert all(torch.equal(x, y) for x, y in zip(a.params, b.params))
    ta, tb = a.state_tensors(), b.state_tensors()
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_state_round_trip_and_resume():
    a = _run(None)
    b = _session(seed=99)             # different init: everything must come from the tensors
    b.load_state_tensors(a.state_tensors())
    for s in (a, b):
        _grad(s, 50)
        s.optim_step(ADAM)
    assert all(torch.equal(x, y) for x, y in zip(a.params, b.params))
    with pytest.raises(ValueError, match="adapter/"):
        b.load_state_tensors({})


def test_refused_steps_change_nothing():
    s = _session()
    with pytest.raises(ServiceError, match="no gradient"):
        s.optim_step(ADAM)
    before = s.state_tensors()
    _grad(s, 1)
    s.params[0].grad[0, 0] = float("nan")
    with pytest.raises(ServiceError, match="gradient norm is nan"):
        s.optim_step(ADAM)
    after = s.state_tensors()
    assert s.step == 0 and s.pending == 0 and all(torch.equal(before[k], after[k]) for k in before)


def test_load_state_waits_for_a_staging_run(monkeypatch):
    """`stage` runs from request threads: a staging run still iterating the optimizer state when a load_state
    replaced it failed the next call with "dictionary changed size during iteration" (CI, test_restart). The load
    now waits for the run (a move that sees the state change under it fails here), and the loaded state is what
    the session then holds."""
    import threading

    s = _run(None)
    want = s.state_tensors()
    _grad(s, 9)
    s.optim_step(ADAM)
    move, started = Session._move, threading.Event()

    def watched_move(self, device, non_blocking):
        before = [id(st) for st in self.optimizer.state.values()]
        started.set()
        threading.Event().wait(0.2)   # the window in which a load could interleave
        if [id(st) for st in self.optimizer.state.values()] != before:
            raise RuntimeError("the optimizer state changed during a move")
        move(self, device, non_blocking)
    s.offload()
    monkeypatch.setattr(Session, "_move", watched_move)
    s.stage()                  # asynchronous: the run is in its window now
    started.wait(5)
    s.load_state_tensors(want)
    s.ready()
    got = s.state_tensors()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
