"""Version chain: full snapshot every N versions and on demand; deltas name their base."""
from __future__ import annotations

import pytest
from _helpers import chain, clone

from k3.sync import SyncError, VersionError, WeightPublisher, WeightReceiver, states_equal
from k3.sync.codec import _Source, read_manifest


def _kinds(payload: bytes):
    m = read_manifest(_Source(payload))
    return m.kind, m.base_version, m.new_version


def test_full_every_n_and_on_demand():
    states = chain(8)
    pub = WeightPublisher(full_every=3, chunk_bytes=64)
    r = None
    kinds = []
    for v, s in enumerate(states):
        p = pub.publish(s, v, full=(v == 5))
        kinds.append(_kinds(p))
        r = WeightReceiver.from_payload(p) if r is None else r
        if v:
            assert r.apply(p) == v
        assert states_equal(r.state_dict(), s) and r.chain == pub.chain
    assert kinds == [("full", None, 0), ("delta", 0, 1), ("delta", 1, 2), ("full", None, 3), ("delta", 3, 4),
                     ("full", None, 5), ("delta", 5, 6), ("delta", 6, 7)]


def test_default_full_every_25():
    pub = WeightPublisher()
    assert pub.full_every == 25
    s = chain(1)[0]
    pub.publish(s, 0)
    assert not pub.next_is_full(24) and pub.next_is_full(25)


def test_publisher_snapshots_state_and_abandoned_iterator_keeps_position():
    states = chain(3)
    pub = WeightPublisher()
    live = clone(states[0])
    p0 = pub.publish(live, 0)
    for k in live:  # the trainer mutates its tensors after publishing: the base copy must not move
        live[k].copy_(states[1][k])
    p1 = pub.publish(live, 1)
    r = WeightReceiver.from_payload(p0)
    r.apply(p1)
    assert states_equal(r.state_dict(), states[1])
    it = pub.publish_iter(states[2], 2)
    next(it)
    it.close()
    assert pub.version == 1  # nothing published
    r.apply(pub.publish(states[2], 2))
    assert states_equal(r.state_dict(), states[2])


def test_versions_must_increase():
    states = chain(2)
    pub = WeightPublisher()
    pub.publish(states[0], 4)
    with pytest.raises(SyncError, match="greater than the last published 4"):
        pub.publish(states[1], 4)


def test_receiver_fell_behind_needs_full():
    states = chain(4)
    pub = WeightPublisher()
    r = WeightReceiver.from_payload(pub.publish(states[0], 0))
    pub.publish(states[1], 1)
    p2 = pub.publish(states[2], 2)
    with pytest.raises(VersionError, match="base_version 1"):
        r.apply(p2)
    r.apply(pub.publish(states[3], 3, full=True))
    assert r.version == 3 and states_equal(r.state_dict(), states[3])
