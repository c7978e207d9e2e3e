"""Transports for k3.sync payloads: a directory of files (atomic rename) and a local socket stream.

Both are pipelined: the sender writes each frame record as soon as the encoder's worker threads have
compressed it (while later chunks are still being compressed), and the receiver decompresses frames on
its worker threads while the next records are still arriving.
"""
from __future__ import annotations

import os
import re
import socket
import uuid
from dataclasses import dataclass
from itertools import chain as iter_chain
from pathlib import Path
from typing import Iterable

from .codec import Piece, _Source, read_manifest
from .format import SyncError
from .receiver import WeightReceiver


def atomic_write(path: Path, pieces: Iterable[Piece]) -> Path:
    """Write `pieces` to `path` so that readers see either the old file or the complete new one:
    a temp file in the same directory, fsync, rename over `path`, fsync the directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            for p in pieces:
                f.write(p)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return path


def _as_pieces(payload: bytes | Iterable[Piece]) -> Iterable[Piece]:
    return [payload] if isinstance(payload, (bytes, bytearray, memoryview)) else payload


@dataclass(frozen=True)
class Entry:
    """One payload file of a directory transport."""
    kind: str
    base_version: int | None
    new_version: int
    path: Path


_NAME = re.compile(r"^v(\d{10})\.(full|from(\d{10})\.delta)\.k3sync$")


class DirectoryTransport:
    """Payload files in one directory: `v<new>.full.k3sync` and `v<new>.from<base>.delta.k3sync`.

    `put` writes a payload atomically (readers never see a partial file); `sync(receiver)` brings a
    receiver to the newest version: along the delta chain from its version when there is one, otherwise
    (or when a delta on the way is refused) from the newest full snapshot and the deltas after it."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def put(self, payload: bytes | Iterable[Piece]) -> Path:
        """Store a payload (bytes, or the pieces of `iter_encode` / `WeightPublisher.publish_iter`)."""
        it = iter(_as_pieces(payload))
        head = next(it)
        man = read_manifest(_Source(head))
        name = (f"v{man.new_version:010d}.full.k3sync" if man.kind == "full"
                else f"v{man.new_version:010d}.from{man.base_version:010d}.delta.k3sync")
        return atomic_write(self.root / name, iter_chain([head], it))

    def entries(self) -> list[Entry]:
        """Complete payload files present, by new version."""
        out = []
        for p in self.root.iterdir():
            m = _NAME.match(p.name)
            if m:
                kind = "full" if m.group(2) == "full" else "delta"
                out.append(Entry(kind, int(m.group(3)) if m.group(3) else None, int(m.group(1)), p))
        return sorted(out, key=lambda e: (e.new_version, e.kind))

    def latest_version(self) -> int | None:
        es = self.entries()
        return max(e.new_version for e in es) if es else None

    def _apply_file(self, receiver: WeightReceiver, e: Entry) -> None:
        with open(e.path, "rb", buffering=1 << 20) as f:
            receiver.apply(f)

    def _follow_deltas(self, receiver: WeightReceiver, entries: list[Entry], target: int) -> None:
        deltas = {e.base_version: e for e in entries if e.kind == "delta"}
        while receiver.version < target and receiver.version in deltas:
            self._apply_file(receiver, deltas[receiver.version])

    def sync(self, receiver: WeightReceiver) -> int:
        """Bring `receiver` to the newest version stored; returns the version reached."""
        entries = self.entries()
        if not entries:
            return receiver.version
        target = max(e.new_version for e in entries)
        try:
            self._follow_deltas(receiver, entries, target)
        except SyncError:
            pass  # the receiver is unchanged by a refused payload; recover from a full snapshot below
        if receiver.version < target:
            fulls = [e for e in entries if e.kind == "full" and e.new_version > receiver.version]
            if not fulls:
                raise SyncError(f"directory {self.root}: no path from version {receiver.version} to {target} "
                                f"(no delta from it and no newer full snapshot)")
            self._apply_file(receiver, fulls[-1])
            self._follow_deltas(receiver, entries, target)
        if receiver.version < target:
            raise SyncError(f"directory {self.root}: delta chain broken after version {receiver.version} "
                            f"(target {target})")
        return receiver.version


# ------------------------------------------------------------------------------------------ socket
def send_payload(sock: socket.socket, payload: bytes | Iterable[Piece]) -> int:
    """Stream one payload over a connected socket and wait for the receiver's acknowledgement.

    Returns the version the receiver reports; raises `SyncError` with the receiver's message if it refused."""
    for p in _as_pieces(payload):
        sock.sendall(p)
    line = _read_line(sock)
    if line.startswith("OK "):
        return int(line[3:])
    raise SyncError(f"receiver refused the payload: {line.removeprefix('ERR ')}")


def _read_line(sock: socket.socket) -> str:
    buf = bytearray()
    while not buf.endswith(b"\n"):
        b = sock.recv(1)
        if not b:
            raise SyncError("receiver closed the connection without acknowledging")
        buf += b
    return buf[:-1].decode()


def serve_socket(receiver: WeightReceiver, sock: socket.socket) -> int:
    """Apply payloads arriving on a connected socket until the sender closes it; acknowledges each one.

    A refused payload is answered with `ERR <message>` and ends the connection (the stream position is
    then unknown); the receiver keeps its previous version. Returns the number of payloads applied."""
    applied = 0
    with sock.makefile("rb", buffering=1 << 20) as f:
        while f.peek(1):
            try:
                v = receiver.apply(f)
            except SyncError as e:
                sock.sendall(f"ERR {e}\n".replace("\n", " ").rstrip().encode() + b"\n")
                return applied
            applied += 1
            sock.sendall(f"OK {v}\n".encode())
    return applied
