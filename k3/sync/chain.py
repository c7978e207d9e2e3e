"""WeightPublisher: the sender's side of the version chain (a delta against the previously published
version, chain semantics as in Fireworks' ARC2 `previous_snapshot_identity`; a full snapshot every
`full_every` versions and on demand)."""
from __future__ import annotations

from typing import Iterator

import torch

from .codec import Piece, StateDict, iter_encode, new_chain_id
from .format import SyncError

DEFAULT_FULL_EVERY = 25


class WeightPublisher:
    """Turns successive published states into payloads.

    Each payload names its base and new version and the publisher's chain id. A full snapshot is sent for
    the first version, whenever `full=True` is asked (e.g. a receiver fell behind or refused a delta), and
    once `full_every` versions have passed since the last full one; otherwise an XOR delta against the
    previously published version. The publisher keeps a copy of the last published state (on the state's
    device) as the next base."""

    def __init__(self, full_every: int = DEFAULT_FULL_EVERY, chain: str | None = None, **codec_kw) -> None:
        if full_every < 1:
            raise SyncError(f"full_every: {full_every} must be >= 1")
        self.full_every = full_every
        self.chain = chain or new_chain_id()
        self.codec_kw = codec_kw
        self._base: dict[str, torch.Tensor] | None = None
        self._version: int | None = None
        self._last_full: int | None = None

    @property
    def version(self) -> int | None:
        """The last version published (None before the first)."""
        return self._version

    def next_is_full(self, version: int) -> bool:
        """Whether publishing `version` now would send a full snapshot."""
        return self._base is None or version - self._last_full >= self.full_every

    def publish_iter(self, state: StateDict, version: int, *, full: bool = False) -> Iterator[Piece]:
        """The payload pieces for `state` at `version`. The publisher advances only once the last piece
        has been produced (an abandoned iterator leaves it where it was)."""
        if self._version is not None and version <= self._version:
            raise SyncError(f"version {version} must be greater than the last published {self._version}")
        snap = {k: v.detach().clone() for k, v in state.items()}
        is_full = full or self.next_is_full(version)
        base = None if is_full else self._base
        yield from iter_encode(snap, base, None if is_full else self._version, version, chain=self.chain,
                               **self.codec_kw)
        self._base, self._version = snap, version
        if is_full:
            self._last_full = version

    def publish(self, state: StateDict, version: int, *, full: bool = False) -> bytes:
        """`publish_iter` joined into one payload."""
        return b"".join(self.publish_iter(state, version, full=full))
