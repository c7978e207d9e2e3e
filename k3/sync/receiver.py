"""WeightReceiver: holds a model's weights at a version and applies full snapshots or XOR deltas atomically."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from .codec import StateDict, _Source, commit, decode_frames, host_bytes, iter_encode, read_manifest
from .format import Manifest, ManifestMismatchError, SyncError, VersionError, dtype_name

PERSIST_FILE = "state.k3sync"


class WeightReceiver:
    """Weights of one model at `version`; `apply(payload)` moves them to the payload's new version.

    The tensors passed in are updated in place on success (so a model built on them sees the new weights).
    A payload is decoded completely into staging (sparse changes or dense chunks) and verified (manifest,
    every frame checksum, the trailer, the reconstructed bytes) before anything is written: a refused
    payload leaves the receiver at its previous version with its previous bytes. With `persist_dir`, every
    applied version is also written there atomically (temp file + fsync + rename) so a killed receiver
    restarts at a known version (`WeightReceiver.restore`)."""

    def __init__(self, state_dict: StateDict, version: int, *, chain: str | None = None,
                 threads: int | None = None, persist_dir: str | os.PathLike | None = None) -> None:
        if not isinstance(version, int) or version < 0:
            raise SyncError(f"version: {version!r} is not a version number")
        if not state_dict:
            raise SyncError("state_dict: empty")
        for name, t in state_dict.items():
            if not isinstance(t, torch.Tensor):
                raise SyncError(f"state_dict: {name!r} is not a tensor")
            if not t.is_contiguous():
                raise SyncError(f"state_dict: tensor {name!r} is not contiguous (cannot be updated in place)")
            dtype_name(t.dtype)
        devices = {t.device.type for t in state_dict.values()}
        if len(devices) != 1:
            raise SyncError(f"state_dict: tensors on several device types {sorted(devices)}")
        self._state = {k: v.detach() for k, v in state_dict.items()}
        self._version = version
        self._chain = chain
        self._threads = threads
        self._persist_dir = Path(persist_dir) if persist_dir is not None else None

    # ------------------------------------------------------------------ accessors
    @property
    def version(self) -> int:
        return self._version

    @property
    def chain(self) -> str | None:
        return self._chain

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The held tensors (live: updated in place by `apply`)."""
        return dict(self._state)

    # ------------------------------------------------------------------ apply
    def check_manifest(self, man: Manifest) -> None:
        """Refuse a payload that does not fit this receiver (version, chain, names, dtypes, shapes)."""
        if man.kind == "delta":
            if man.base_version != self._version:
                raise VersionError(f"delta base_version {man.base_version} (-> {man.new_version}) does not match "
                                   f"the receiver's version {self._version}")
            if man.chain is not None and self._chain is not None and man.chain != self._chain:
                raise VersionError(f"delta chain {man.chain!r} differs from the receiver's chain {self._chain!r} "
                                   f"(same version number, different publisher): a full snapshot is needed")
        elif man.chain is not None and man.chain == self._chain and man.new_version < self._version:
            raise VersionError(f"full snapshot version {man.new_version} is older than the receiver's "
                               f"{self._version} on the same chain")
        names = [e.name for e in man.tensors]
        missing, unknown = sorted(set(self._state) - set(names)), sorted(set(names) - set(self._state))
        if missing:
            raise ManifestMismatchError(f"payload is missing tensor(s) {missing}")
        if unknown:
            raise ManifestMismatchError(f"payload has tensor(s) unknown to the receiver {unknown}")
        for e in man.tensors:
            t = self._state[e.name]
            if e.dtype != t.dtype:
                raise ManifestMismatchError(f"tensor {e.name!r}: payload dtype {dtype_name(e.dtype)} != receiver "
                                            f"dtype {dtype_name(t.dtype)}")
            if e.shape != tuple(t.shape):
                raise ManifestMismatchError(f"tensor {e.name!r}: payload shape {list(e.shape)} != receiver shape "
                                            f"{list(t.shape)}")

    def apply(self, payload) -> int:
        """Apply one payload (bytes, or a binary stream positioned at a payload); returns the new version.

        Raises a `SyncError` subclass naming the tensor/field at fault; the receiver is then unchanged."""
        src = _Source(payload)
        man = read_manifest(src)
        self.check_manifest(man)
        if next(iter(self._state.values())).is_cuda:
            from .gpu import cuda_apply

            cuda_apply(self._state, src, man, self._threads)
        else:
            live = {n: host_bytes(t) for n, t in self._state.items()}
            staged = decode_frames(src, man, live, self._threads)
            commit(staged, live, self._threads)  # everything verified: apply in place
        self._version, self._chain = man.new_version, man.chain
        if self._persist_dir is not None:
            self.save(self._persist_dir)
        return self._version

    # ------------------------------------------------------------------ persistence
    def save(self, directory: str | os.PathLike) -> Path:
        """Write the held weights as a full snapshot to `directory/state.k3sync`, atomically."""
        from .transport import atomic_write

        pieces = iter_encode({k: v.cpu() for k, v in self._state.items()}, None, None, self._version,
                             chain=self._chain, threads=self._threads)
        return atomic_write(Path(directory) / PERSIST_FILE, pieces)

    @classmethod
    def from_payload(cls, payload, *, threads: int | None = None, device: str | torch.device = "cpu",
                     persist_dir: str | os.PathLike | None = None) -> "WeightReceiver":
        """A receiver built from a full-snapshot payload (bytes or stream)."""
        src = _Source(payload)
        man = read_manifest(src)
        if man.kind != "full":
            raise SyncError(f"from_payload: needs a full snapshot, got a {man.kind} payload")
        state = {e.name: torch.empty(e.shape, dtype=e.dtype) for e in man.tensors}
        commit(decode_frames(src, man, None, threads), {n: host_bytes(t) for n, t in state.items()}, threads)
        state = {k: v.to(device) for k, v in state.items()}
        return cls(state, man.new_version, chain=man.chain, threads=threads, persist_dir=persist_dir)

    @classmethod
    def restore(cls, directory: str | os.PathLike, **kw) -> "WeightReceiver":
        """Restart a receiver from what `save` (or `persist_dir`) wrote."""
        path = Path(directory) / PERSIST_FILE
        with open(path, "rb") as f:
            return cls.from_payload(f, **kw)


def states_equal(a: StateDict, b: StateDict) -> bool:
    """Bit-for-bit equality of two state dicts (same names, dtypes, shapes and raw bytes)."""
    if set(a) != set(b):
        return False
    for k in a:
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if not np.array_equal(host_bytes(x.cpu()), host_bytes(y.cpu())):
            return False
    return True
