"""Durable state of the service: session and sampler metadata in SQLite, tensors in safetensors files.

A session's training state (adapter + AdamW moments and step count) is one safetensors file per optimizer step,
`sessions/<id>/step-<n>.safetensors`, written to a temporary name, fsynced and renamed; only then does the
SQLite row move to the new step (one transaction). A crash at any point leaves the row on a complete file: the
step happened durably, or not at all. Named checkpoints (`save_state`) and sampler snapshots are files the same
way; sampler files beyond a session's newest `keep_samplers` are removed (row first, then the file: a crash between
leaves an unreferenced file, which the next start deletes). API keys are stored as SHA-256 digests (the keys are 256 random bits; no slow hash is needed)."""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY, key_hash TEXT NOT NULL, lora TEXT NOT NULL, seed INTEGER NOT NULL,
    step INTEGER NOT NULL, state_file TEXT NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS checkpoints (
    session TEXT NOT NULL, name TEXT NOT NULL, step INTEGER NOT NULL, file TEXT NOT NULL,
    PRIMARY KEY (session, name));
CREATE TABLE IF NOT EXISTS samplers (
    id TEXT PRIMARY KEY, session TEXT NOT NULL, name TEXT NOT NULL, step INTEGER NOT NULL, file TEXT NOT NULL);
"""


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_matches(key: str, digest: str) -> bool:
    return hmac.compare_digest(hash_key(key), digest)


@dataclass(frozen=True)
class SessionRow:
    id: str
    key_hash: str
    lora: dict
    seed: int
    step: int
    state_file: str


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None) -> None:
    """Atomically write a safetensors file (temporary file, fsync, rename, fsync of the directory)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp), metadata=meta)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


class Store:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.db = sqlite3.connect(str(self.root / "service.db"), check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    def _tx(self, statements: list[tuple[str, tuple]]) -> None:
        with self._lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                for sql, args in statements:
                    self.db.execute(sql, args)
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise

    # ------------------------------------------------------------------ sessions
    def state_path(self, sid: str, step: int) -> Path:
        return self.root / "sessions" / sid / f"step-{step}.safetensors"

    def add_session(self, row: SessionRow, created: float) -> None:
        self._tx([("INSERT INTO sessions VALUES (?, ?, ?, ?, ?, ?, ?)",
                   (row.id, row.key_hash, json.dumps(row.lora), row.seed, row.step, row.state_file, created))])

    def commit_step(self, sid: str, step: int, state_file: str) -> None:
        self._tx([("UPDATE sessions SET step = ?, state_file = ? WHERE id = ?", (step, state_file, sid))])

    def sessions(self) -> list[SessionRow]:
        with self._lock:
            rows = self.db.execute("SELECT id, key_hash, lora, seed, step, state_file FROM sessions "
                                   "ORDER BY created, id").fetchall()
        return [SessionRow(r[0], r[1], json.loads(r[2]), r[3], r[4], r[5]) for r in rows]

    def delete_session(self, sid: str) -> None:
        self._tx([("DELETE FROM sessions WHERE id = ?", (sid,)),
                  ("DELETE FROM checkpoints WHERE session = ?", (sid,)),
                  ("DELETE FROM samplers WHERE session = ?", (sid,))])

    # ------------------------------------------------------------------ checkpoints and samplers
    def put_checkpoint(self, sid: str, name: str, step: int, file: str) -> None:
        self._tx([("INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?)", (sid, name, step, file))])

    def checkpoint(self, sid: str, name: str) -> tuple[int, str] | None:
        with self._lock:
            r = self.db.execute("SELECT step, file FROM checkpoints WHERE session = ? AND name = ?",
                                (sid, name)).fetchone()
        return None if r is None else (r[0], r[1])

    def add_sampler(self, sampler_id: str, sid: str, name: str, step: int, file: str) -> None:
        self._tx([("INSERT OR REPLACE INTO samplers VALUES (?, ?, ?, ?, ?)", (sampler_id, sid, name, step, file))])

    def delete_samplers(self, sampler_ids: list[str]) -> None:
        self._tx([("DELETE FROM samplers WHERE id = ?", (i,)) for i in sampler_ids])

    def samplers(self) -> list[tuple[str, str, str, int, str]]:
        with self._lock:
            return self.db.execute("SELECT id, session, name, step, file FROM samplers ORDER BY rowid").fetchall()
