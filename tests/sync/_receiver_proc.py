"""Receiver process used by the transport tests (run as a script).

    socket MODE: serve payloads on a unix socket, then save the final state to OUT
    dir MODE:    restore from PERSIST and sync from DIR; with KILLPOINT set, stop at that point (marker
                 file written, then sleep) so the test can SIGKILL the process mid-apply
"""
from __future__ import annotations

import os
import socket
import sys
import time

import k3.sync.receiver as receiver_mod
import k3.sync.transport as transport_mod
from k3.sync import DirectoryTransport, WeightReceiver, serve_socket


def _hang(marker: str) -> None:
    open(marker, "w").close()
    time.sleep(120)


def main() -> None:
    mode = sys.argv[1]
    if mode == "socket":
        path, init, out = sys.argv[2:5]
        with open(init, "rb") as f:
            r = WeightReceiver.from_payload(f)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        srv.listen(1)
        conn, _ = srv.accept()
        serve_socket(r, conn)
        conn.close()
        r.save(out)
        return
    directory, persist, killpoint, marker = sys.argv[2:6]
    r = WeightReceiver.restore(persist, persist_dir=persist)
    calls = {"decode": 0, "persist": 0}
    if killpoint == "decode":  # killed after decoding the 2nd payload into staging, before the commit
        real = receiver_mod.decode_frames

        def decode(*a, **k):
            staged = real(*a, **k)
            calls["decode"] += 1
            if calls["decode"] == 2:
                _hang(marker)
            return staged
        receiver_mod.decode_frames = decode
    elif killpoint == "persist":  # killed half way through writing the 2nd persisted state
        real_write = transport_mod.atomic_write

        def write(path, pieces):
            calls["persist"] += 1
            if calls["persist"] == 2:
                def slow():
                    for i, p in enumerate(pieces):
                        yield p
                        if i == 3:
                            _hang(marker)
                return real_write(path, slow())
            return real_write(path, pieces)
        transport_mod.atomic_write = write
    DirectoryTransport(directory).sync(r)
    os._exit(0)


if __name__ == "__main__":
    main()
