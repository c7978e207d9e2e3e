"""Transports: directory (atomic files, chain following, recovery) and a socket stream between processes;
a receiver killed mid-apply restarts at a known version and catches up."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _helpers import chain

from k3.sync import (DirectoryTransport, SyncError, WeightPublisher, WeightReceiver, send_payload, states_equal)

HERE = Path(__file__).parent
ROOT = HERE.parents[1]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE), env.get("PYTHONPATH", "")])
    return env


def _publish_dir(tmp_path, states, full_every=25, **kw):
    d = DirectoryTransport(tmp_path / "pub")
    pub = WeightPublisher(full_every=full_every, chunk_bytes=256, **kw)
    for v, s in enumerate(states):
        d.put(pub.publish_iter(s, v))
    return d, pub


def test_directory_put_names_and_sync(tmp_path):
    states = chain(5)
    d, _ = _publish_dir(tmp_path, states, full_every=3)
    names = sorted(p.name for p in d.root.iterdir())
    assert names == ["v0000000000.full.k3sync", "v0000000001.from0000000000.delta.k3sync",
                     "v0000000002.from0000000001.delta.k3sync", "v0000000003.full.k3sync",
                     "v0000000004.from0000000003.delta.k3sync"]
    r = WeightReceiver.from_payload((d.root / names[0]).read_bytes())
    assert d.sync(r) == 4 and states_equal(r.state_dict(), states[4])
    assert d.sync(r) == 4


def test_directory_sync_recovers_from_corrupt_delta_via_full(tmp_path):
    states = chain(6)
    d, _ = _publish_dir(tmp_path, states, full_every=4)
    r = WeightReceiver.from_payload((d.root / "v0000000000.full.k3sync").read_bytes())
    bad = d.root / "v0000000002.from0000000001.delta.k3sync"
    data = bytearray(bad.read_bytes())
    data[-40] ^= 0xFF
    bad.write_bytes(bytes(data))
    assert d.sync(r) == 5 and states_equal(r.state_dict(), states[5])  # via full v4 + delta v5


def test_directory_sync_no_path_raises_and_keeps_state(tmp_path):
    states = chain(4)
    d, _ = _publish_dir(tmp_path, states)
    r = WeightReceiver.from_payload((d.root / "v0000000000.full.k3sync").read_bytes())
    (d.root / "v0000000002.from0000000001.delta.k3sync").unlink()
    with pytest.raises(SyncError, match="no path from version 1 to 3"):
        d.sync(r)
    assert r.version == 1 and states_equal(r.state_dict(), states[1])


def test_socket_stream_between_processes(tmp_path):
    states = chain(4)
    pub = WeightPublisher(chunk_bytes=128)
    init = tmp_path / "init.k3sync"
    init.write_bytes(pub.publish(states[0], 0))
    sock_path, out = str(tmp_path / "s.sock"), tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(HERE / "_receiver_proc.py"), "socket", sock_path, str(init),
                             str(out)], env=_env())
    try:
        deadline = time.time() + 60
        while not os.path.exists(sock_path):
            assert proc.poll() is None and time.time() < deadline, "receiver process did not start"
            time.sleep(0.05)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(sock_path)
            assert send_payload(s, pub.publish_iter(states[1], 1)) == 1
            assert send_payload(s, pub.publish_iter(states[2], 2)) == 2
            bad = bytearray(pub.publish(states[3], 3))
            bad[len(bad) // 2] ^= 1
            with pytest.raises(SyncError, match="receiver refused the payload: .*tensor"):
                send_payload(s, bytes(bad))
        assert proc.wait(60) == 0
    finally:
        proc.kill()
    got = WeightReceiver.restore(out)
    assert got.version == 2 and states_equal(got.state_dict(), states[2])


@pytest.mark.parametrize("killpoint", ["decode", "persist"])
def test_receiver_killed_mid_apply_restarts_at_known_version(tmp_path, killpoint):
    states = chain(4)
    d, pub = _publish_dir(tmp_path, states)
    persist = tmp_path / "persist"
    WeightReceiver.from_payload((d.root / "v0000000000.full.k3sync").read_bytes()).save(persist)
    marker = tmp_path / "marker"
    proc = subprocess.Popen([sys.executable, str(HERE / "_receiver_proc.py"), "dir", str(d.root), str(persist),
                             killpoint, str(marker)], env=_env())
    try:
        deadline = time.time() + 60
        while not marker.exists():
            assert proc.poll() is None, "receiver process exited before the kill point"
            assert time.time() < deadline
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    # restart: the persisted state is a complete known version (v1: the 2nd apply never committed/persisted)
    r = WeightReceiver.restore(persist, persist_dir=persist)
    assert r.version == 1 and states_equal(r.state_dict(), states[1])
    assert d.sync(r) == 3 and states_equal(r.state_dict(), states[3])
    assert WeightReceiver.restore(persist).version == 3
