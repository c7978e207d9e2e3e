"""Two-tier pools: spill to the host tier and restore bit-exactly, reclaim when both tiers are full, refuse
when everything is pinned, reference counting."""
import pytest
import torch

from k3.rollout.pools import PoolExhausted, TieredPool


def make(dev=2, host=2):
    return TieredPool("p", {"x": ((3,), torch.float32)}, dev, host, "cpu")


def test_spill_and_restore_round_trip():
    pool = make()
    a, b = pool.alloc(), pool.alloc()
    pool.dev["x"][pool.slot(a)] = torch.tensor([1.0, 2.0, 3.0])
    pool.dev["x"][pool.slot(b)] = torch.tensor([4.0, 5.0, 6.0])
    pool.unpin(a)
    pool.unpin(b)
    pool.touch(b)               # a is least recently used
    c = pool.alloc()            # spills a
    assert pool.items[a].tier == "host" and pool.stats["spills"] == 1
    pool.unpin(c)
    pool.pin(a)                 # restores a (spilling b, the LRU unpinned one)
    assert pool.items[a].tier == "device" and pool.stats["restores"] == 1
    assert torch.equal(pool.dev["x"][pool.slot(a)], torch.tensor([1.0, 2.0, 3.0]))
    pool.pin(b)
    assert torch.equal(pool.dev["x"][pool.slot(b)], torch.tensor([4.0, 5.0, 6.0]))
    pool.check()


def test_reclaimer_runs_when_host_is_full_and_pinned_items_are_never_victims():
    pool = make(dev=1, host=1)
    a = pool.alloc()
    pool.unpin(a)
    b = pool.alloc()            # a -> host
    pool.unpin(b)
    calls = []

    def reclaim(tier):
        calls.append(tier)
        victims = [i for i, it in pool.items.items() if it.tier == tier and it.pin == 0]
        if not victims:
            return False
        pool.decref(victims[0])
        return True
    pool.reclaimer = reclaim
    c = pool.alloc()            # device full, host full: drops the spilled item first, then spills b
    assert calls[0] == "host" and a not in pool.items and pool.items[b].tier == "host"
    with pytest.raises(PoolExhausted, match="pinned"):
        pool.alloc()            # the only device slot holds c, which is pinned
    assert pool.items[c].pin == 1 and pool.items[b].tier == "host"
    pool.check()


def test_refcounts_and_copy_on_write():
    pool = make()
    a = pool.alloc()
    pool.dev["x"][pool.slot(a)] = 7.0
    c = pool.copy(a)
    assert torch.equal(pool.dev["x"][pool.slot(c)], pool.dev["x"][pool.slot(a)])
    pool.dev["x"][pool.slot(c)] = 1.0
    assert float(pool.dev["x"][pool.slot(a)][0]) == 7.0
    pool.incref(a)
    pool.unpin(a)
    pool.decref(a)
    assert a in pool.items
    pool.decref(a)
    assert a not in pool.items
    with pytest.raises(RuntimeError, match="pinned"):
        pool.decref(c)
    pool.check()
