"""XOR-delta codec: per tensor, XOR of the raw bytes against the base, byte-plane shuffled, zstd-compressed
in bounded chunks on a thread pool; decoding reproduces the new weights bit for bit.

Encoding and decoding are pipelines: the calling thread produces/reads frame records in order while worker
threads XOR, hash and (de)compress chunks (numpy, xxhash and zstd release the GIL). At most `2 * threads`
chunks are in flight, so memory stays bounded for multi-GB tensors. CUDA tensors take the GPU path
(`k3.sync.gpu`): XOR in Triton on the device, copy to pinned host memory, compression on the host.
"""
from __future__ import annotations

import os
import threading
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Callable, Iterable, Iterator, Mapping, NamedTuple

import numpy as np
import torch
import xxhash
import zstandard as zstd

from .format import (END_MAGIC, FLAG_NEW_HASH, FLAG_SPARSE, FORMAT_VERSION, FRAME, FRAME_MAGIC, MAGIC,
                     MAX_MANIFEST_BYTES, TRAILER, U32, U64, CorruptPayloadError, Manifest, SyncError, TensorEntry,
                     dtype_name, pack_header, parse_manifest, unpack_manifest_json, xxh3)

DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_LEVEL = 1
StateDict = Mapping[str, torch.Tensor]
Piece = bytes | memoryview


def default_threads() -> int:
    """Worker threads for (de)compression: the machine's logical CPUs."""
    return max(1, os.cpu_count() or 1)


# ----------------------------------------------------------------------------------------- byte helpers
def host_bytes(t: torch.Tensor) -> np.ndarray:
    """Flat uint8 numpy view of a CPU tensor's raw bytes (no copy for contiguous tensors)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


def _wide(a: np.ndarray) -> np.ndarray:
    """The same bytes as uint64 words when length and alignment allow (XOR runs faster on words)."""
    if a.size % 8 == 0 and a.ctypes.data % 8 == 0:
        return a.view(np.uint64)
    return a


def xor_into(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out = a ^ b over raw bytes (uint8 arrays of equal length)."""
    wa, wb, wo = _wide(a), _wide(b), _wide(out)
    if wa.dtype == wb.dtype == wo.dtype:
        np.bitwise_xor(wa, wb, out=wo)
    else:
        np.bitwise_xor(a, b, out=out)
    return out


def shuffle_into(raw: np.ndarray, width: int, out: np.ndarray) -> np.ndarray:
    """Byte-plane shuffle: element bytes [b0 b1 ...] of n elements -> planes [all b0][all b1]...

    For a bf16 XOR delta the high plane (sign, exponent, top mantissa bits) is almost all zeros and the
    low plane holds the few flipped mantissa bits, which zstd compresses better than interleaved bytes."""
    n = raw.size // width
    out.reshape(width, n)[...] = raw.reshape(n, width).T
    return out


def unshuffle_into(planes: np.ndarray, width: int, out: np.ndarray) -> np.ndarray:
    """Inverse of `shuffle_into`."""
    n = planes.size // width
    out.reshape(n, width)[...] = planes.reshape(width, n).T
    return out


class _Scratch(threading.local):
    """Per-thread reusable buffers and zstd contexts (contexts are not thread-safe)."""

    def __init__(self) -> None:
        self.bufs: dict[str, np.ndarray] = {}
        self.cctx: dict[int, zstd.ZstdCompressor] = {}
        self.dctx = zstd.ZstdDecompressor()

    def buf(self, key: str, n: int) -> np.ndarray:
        b = self.bufs.get(key)
        if b is None or b.size < n:
            b = np.empty(max(n, 1), dtype=np.uint8)
            self.bufs[key] = b
        return b[:n]

    def compressor(self, level: int) -> zstd.ZstdCompressor:
        c = self.cctx.get(level)
        if c is None:
            c = zstd.ZstdCompressor(level=level, write_checksum=False, write_content_size=True)
            self.cctx[level] = c
        return c


_SCRATCH = _Scratch()


def pipeline(tasks: Iterable[Callable[[], object]], threads: int, depth: int | None = None) -> Iterator[object]:
    """Run `tasks` on a thread pool, yielding results in task order with at most `depth` in flight.

    A task is created (the iterable advanced) only after the task `depth` places earlier was consumed, so
    producers may recycle `depth` buffers."""
    depth = depth or 2 * threads
    pending: deque[Future] = deque()
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="k3sync") as pool:
        try:
            it = iter(tasks)
            while True:
                while len(pending) >= depth:
                    yield pending.popleft().result()
                task = next(it, None)
                if task is None:
                    break
                pending.append(pool.submit(task))
            while pending:
                yield pending.popleft().result()
        finally:
            for f in pending:
                f.cancel()


# ------------------------------------------------------------------------------------------- encoding
def _check_state(state: StateDict, what: str) -> None:
    if not isinstance(state, Mapping) or not state:
        raise SyncError(f"{what}: expected a non-empty mapping of name -> tensor")
    for name, t in state.items():
        if not isinstance(name, str):
            raise SyncError(f"{what}: tensor name {name!r} is not a string")
        if not isinstance(t, torch.Tensor):
            raise SyncError(f"{what}: {name!r} is not a tensor")


def _frame_record(ti: int, ci: int, off: int, raw_len: int, stored: np.ndarray, new_hash: int | None,
                  level: int, sparse: bool = False) -> list[Piece]:
    """Compress one chunk (already XORed and packed into `stored`) into a frame record."""
    comp = _SCRATCH.compressor(level).compress(stored)
    flags = (FLAG_NEW_HASH if new_hash is not None else 0) | (FLAG_SPARSE if sparse else 0)
    hdr = FRAME.pack(FRAME_MAGIC, ti, ci, off, raw_len, len(comp), xxh3(stored), new_hash or 0, flags)
    h = xxh3_parts(hdr, comp)
    return [hdr + U64.pack(h), comp]


_WORD = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
SPARSE_MAX_DENSITY = 0.25  # above this fraction of changed elements a chunk is stored dense
_SPARSE_HDR = np.dtype("<u4")


def _sparse_bytes(idx: np.ndarray, vals: np.ndarray, itemsize: int, width: int) -> np.ndarray:
    """Sparse chunk layout (uint8): u32 count | u32 big-gap count | count gap bytes (elements skipped since
    the previous change; 255 = the gap is the next entry of the big-gap list) | big gaps (u32) | the changed
    XOR words, byte-plane split when `width` > 1. After zstd a change costs ~6-7 bits of position plus a
    few bits of bf16 XOR."""
    nnz = idx.size
    gaps = np.diff(idx, prepend=-1) - 1
    big = gaps >= 255
    bigs = gaps[big].astype(_SPARSE_HDR)
    out = np.empty(8 + nnz + 4 * bigs.size + nnz * itemsize, dtype=np.uint8)
    out[:8].view(_SPARSE_HDR)[:] = (nnz, bigs.size)
    small = out[8:8 + nnz]
    small[:] = gaps.astype(np.uint8)
    small[big] = 255
    pos = 8 + nnz
    out[pos:pos + 4 * bigs.size] = bigs.view(np.uint8)
    pos += 4 * bigs.size
    vb = np.ascontiguousarray(vals).view(np.uint8)
    if width > 1:
        shuffle_into(vb, width, out[pos:])
    else:
        out[pos:] = vb
    return out


def pack_sparse(xor: np.ndarray, itemsize: int, width: int) -> np.ndarray | None:
    """Sparse form of an XOR chunk, or None when more than SPARSE_MAX_DENSITY of its elements changed."""
    words = xor.view(_WORD[itemsize])
    idx = np.flatnonzero(words != 0)
    if idx.size > SPARSE_MAX_DENSITY * words.size:
        return None
    return _sparse_bytes(idx, words[idx], itemsize, width)


def unpack_sparse(stored: np.ndarray, itemsize: int, width: int, n_words: int,
                  where: str) -> tuple[np.ndarray, np.ndarray]:
    """(element indices, XOR words) of a sparse chunk of `n_words` elements; validates the layout."""
    if stored.size < 8:
        raise CorruptPayloadError(f"{where}: sparse frame shorter than its header")
    nnz, nbig = (int(v) for v in stored[:8].view(_SPARSE_HDR))
    if stored.size != 8 + nnz + 4 * nbig + nnz * itemsize or nnz > n_words:
        raise CorruptPayloadError(f"{where}: sparse frame length does not match its counts")
    small = stored[8:8 + nnz]
    gaps = small.astype(np.int64)
    is_big = small == 255
    if int(np.count_nonzero(is_big)) != nbig:
        raise CorruptPayloadError(f"{where}: sparse frame big-gap count mismatch")
    pos = 8 + nnz
    gaps[is_big] = stored[pos:pos + 4 * nbig].view(_SPARSE_HDR)
    pos += 4 * nbig
    idx = np.cumsum(gaps + 1) - 1
    if nnz and idx[-1] >= n_words:
        raise CorruptPayloadError(f"{where}: sparse frame position {int(idx[-1])} beyond the chunk")
    vals = np.empty(nnz * itemsize, dtype=np.uint8)
    if width > 1:
        unshuffle_into(stored[pos:], width, vals)
    else:
        vals[:] = stored[pos:]
    return idx, vals.view(_WORD[itemsize])


def pack_chunk(raw: np.ndarray, width: int, itemsize: int, delta: bool, sparse: bool = True
               ) -> tuple[np.ndarray, bool]:
    """The bytes to compress for one chunk given its XOR (delta) or new bytes (full): sparse for a sparse
    delta (when `sparse`), else byte-plane shuffled (when `width` > 1)."""
    if delta and sparse and itemsize in _WORD:
        sp = pack_sparse(raw, itemsize, width)
        if sp is not None:
            return sp, True
    return (shuffle_into(raw, width, _SCRATCH.buf("shuf", raw.size)) if width > 1 else raw), False


def pack_delta_chunk(new: np.ndarray, base: np.ndarray, width: int, itemsize: int, sparse: bool = True
                     ) -> tuple[np.ndarray, bool]:
    """`pack_chunk` of new XOR base, without materializing the XOR when the chunk is sparse."""
    if sparse and itemsize in _WORD:
        nw, bw = new.view(_WORD[itemsize]), base.view(_WORD[itemsize])
        idx = np.flatnonzero(nw != bw)
        if idx.size <= SPARSE_MAX_DENSITY * nw.size:
            return _sparse_bytes(idx, nw[idx] ^ bw[idx], itemsize, width), True
    raw = xor_into(new, base, _SCRATCH.buf("xor", new.size))
    return (shuffle_into(raw, width, _SCRATCH.buf("shuf", raw.size)) if width > 1 else raw), False


def xxh3_parts(*parts: Piece) -> int:
    """xxh3-64 over the concatenation of `parts`, without concatenating."""
    x = xxhash.xxh3_64()
    for p in parts:
        x.update(p)
    return x.intdigest()


def _cpu_task(ti: int, ci: int, off: int, n: int, new: np.ndarray, base: np.ndarray | None, width: int,
              itemsize: int, level: int, sparse: bool) -> Callable[[], list[Piece]]:
    def run() -> list[Piece]:
        chunk = new[off:off + n]
        if base is None:
            stored, is_sparse = pack_chunk(chunk, width, itemsize, False)
        else:
            stored, is_sparse = pack_delta_chunk(chunk, base[off:off + n], width, itemsize, sparse)
        return _frame_record(ti, ci, off, n, stored, xxh3(chunk), level, is_sparse)
    return run


def iter_encode(new: StateDict, base: StateDict | None, base_version: int | None, new_version: int, *,
                level: int = DEFAULT_LEVEL, chunk_bytes: int = DEFAULT_CHUNK_BYTES, threads: int | None = None,
                shuffle: bool = True, sparse: bool = True, chain: str | None = None) -> Iterator[Piece]:
    """Encode a full snapshot (`base is None`) or an XOR delta as a stream of byte pieces (the payload is
    their concatenation). Compression of later chunks overlaps with the consumer of earlier pieces.
    `shuffle`: byte-plane split multi-byte elements; `sparse`: store sparse delta chunks as positions +
    XOR words (both on by default; off only to measure their effect)."""
    _check_state(new, "new state")
    if not isinstance(new_version, int) or new_version < 0:
        raise SyncError(f"new_version: {new_version!r} is not a version number")
    if base is not None:
        _check_state(base, "base state")
        if not isinstance(base_version, int) or base_version < 0:
            raise SyncError(f"base_version: {base_version!r} is not a version number")
        if new_version <= base_version:
            raise SyncError(f"new_version {new_version} must be greater than base_version {base_version}")
        missing, extra = sorted(set(new) - set(base)), sorted(set(base) - set(new))
        if missing or extra:
            raise SyncError(f"base and new states differ in tensors: only in new {missing}, only in base {extra}")
    if chunk_bytes <= 0 or chunk_bytes % 16:
        raise SyncError(f"chunk_bytes: {chunk_bytes} is not a positive multiple of 16")
    threads = threads or default_threads()
    entries, plan = [], []
    on_cuda = False
    for name, t in new.items():
        b = base[name] if base is not None else None
        if b is not None and (b.dtype != t.dtype or tuple(b.shape) != tuple(t.shape)):
            raise SyncError(f"tensor {name!r}: base is {b.dtype}{tuple(b.shape)}, new is {t.dtype}{tuple(t.shape)}")
        if b is not None and b.device != t.device:
            raise SyncError(f"tensor {name!r}: base on {b.device}, new on {t.device}")
        on_cuda |= t.is_cuda
        width = t.element_size() if shuffle and t.element_size() > 1 else 1
        nbytes = t.numel() * t.element_size()
        frames = -(-nbytes // chunk_bytes)
        entries.append({"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "nbytes": nbytes,
                        "shuffle": width, "frames": frames})
        plan.append((t, b, width, nbytes, frames))
    meta = {"format": "k3sync", "format_version": FORMAT_VERSION, "kind": "full" if base is None else "delta",
            "base_version": base_version if base is not None else None, "new_version": new_version,
            "chain": chain, "chunk_bytes": chunk_bytes, "level": level, "codec": "zstd", "tensors": entries}
    header, js = pack_header(meta)
    yield header

    if on_cuda:
        from .gpu import cuda_tasks

        tasks = cuda_tasks(plan, chunk_bytes, level, 2 * threads, sparse)
    else:
        tasks = _cpu_tasks(plan, chunk_bytes, level, sparse)
    all_hashes = xxhash.xxh3_64()
    count = 0
    for pieces in pipeline(tasks, threads):
        all_hashes.update(pieces[0][-8:])
        count += 1
        yield from pieces
    yield TRAILER.pack(END_MAGIC, count, all_hashes.intdigest(), xxh3(js))


def _cpu_tasks(plan, chunk_bytes: int, level: int, sparse: bool) -> Iterator[Callable[[], list[Piece]]]:
    for ti, (t, b, width, nbytes, frames) in enumerate(plan):
        if t.device.type != "cpu":
            raise SyncError(f"tensor {t.device} mixes devices: put all tensors on one device")
        nb, bb = host_bytes(t), (host_bytes(b) if b is not None else None)
        for ci in range(frames):
            off = ci * chunk_bytes
            yield _cpu_task(ti, ci, off, min(chunk_bytes, nbytes - off), nb, bb, width, t.element_size(), level,
                            sparse)


def encode_delta(base: StateDict, new: StateDict, base_version: int, new_version: int, **kw) -> bytes:
    """One self-describing payload taking `base` (at `base_version`) to `new` (at `new_version`).

    Keyword options: level (zstd, default 1), chunk_bytes (default 4 MiB), threads, shuffle and sparse
    (default True), chain (an id tying the payload to one publisher's version chain)."""
    return b"".join(iter_encode(new, base, base_version, new_version, **kw))


def encode_full(state: StateDict, version: int, **kw) -> bytes:
    """One self-describing full-snapshot payload of `state` at `version` (options as `encode_delta`)."""
    return b"".join(iter_encode(state, None, None, version, **kw))


def new_chain_id() -> str:
    """A fresh id for a publisher's version chain."""
    return uuid.uuid4().hex


# ------------------------------------------------------------------------------------------- decoding
class _Source:
    """Exact reads from bytes (zero-copy) or a binary stream; short reads raise CorruptPayloadError."""

    def __init__(self, src) -> None:
        if isinstance(src, (bytes, bytearray, memoryview)):
            self.buf: memoryview | None = memoryview(src).cast("B")
            self.stream = None
        elif hasattr(src, "read"):
            self.buf, self.stream = None, src
        else:
            raise SyncError(f"payload: expected bytes or a readable binary stream, got {type(src).__name__}")
        self.pos = 0

    def read(self, n: int, what: str) -> Piece:
        if self.buf is not None:
            out = self.buf[self.pos:self.pos + n]
        else:
            parts, got = [], 0
            while got < n:
                p = self.stream.read(n - got)
                if not p:
                    break
                parts.append(p)
                got += len(p)
            out = parts[0] if len(parts) == 1 else b"".join(parts)
        if len(out) != n:
            raise CorruptPayloadError(f"payload truncated while reading {what} (wanted {n} bytes, got {len(out)})")
        self.pos += n
        return out

    def at_end(self) -> bool:
        return self.buf is None or self.pos == len(self.buf)


def read_manifest(src: _Source) -> Manifest:
    """Read and verify the payload header."""
    magic = bytes(src.read(len(MAGIC), "header magic"))
    if magic != MAGIC:
        raise CorruptPayloadError(f"header: bad magic {magic!r} (not a k3.sync payload or wrong format version)")
    (n,) = U32.unpack(src.read(4, "manifest length"))
    if n > MAX_MANIFEST_BYTES:
        raise CorruptPayloadError(f"header: manifest length {n} exceeds {MAX_MANIFEST_BYTES}")
    comp = bytes(src.read(n, "manifest"))
    (h,) = U64.unpack(src.read(8, "manifest checksum"))
    if xxh3(comp) != h:
        raise CorruptPayloadError("header: manifest checksum mismatch")
    return parse_manifest(unpack_manifest_json(comp))


class FrameRecord(NamedTuple):
    """One frame record as read from a payload (structure checked, checksums not yet)."""
    entry: TensorEntry
    index: int
    offset: int
    raw_len: int
    header: bytes
    checksum: int
    data: Piece
    raw_hash: int
    new_hash: int | None
    sparse: bool


def iter_frame_records(src: _Source, man: Manifest) -> Iterator[FrameRecord]:
    """Read the frame records of a payload whose manifest was read, in order, then verify the trailer."""
    all_hashes = xxhash.xxh3_64()
    bound = man.chunk_bytes + (man.chunk_bytes >> 7) + 4096
    for ti, e in enumerate(man.tensors):
        for ci in range(e.frames):
            what = f"tensor {e.name!r} frame {ci}"
            hdr = bytes(src.read(FRAME.size, f"{what} header"))
            (h,) = U64.unpack(src.read(8, f"{what} checksum"))
            magic, t_i, c_i, off, raw_len, comp_len, raw_hash, new_hash, flags = FRAME.unpack(hdr)
            exp_off = ci * man.chunk_bytes
            if magic != FRAME_MAGIC:
                raise CorruptPayloadError(f"{what}: bad frame magic {magic!r}")
            if (t_i, c_i, off) != (ti, ci, exp_off) or raw_len != min(man.chunk_bytes, e.nbytes - exp_off):
                raise CorruptPayloadError(f"{what}: record says tensor #{t_i} frame {c_i} offset {off} "
                                          f"length {raw_len}; expected #{ti} frame {ci} offset {exp_off}")
            if comp_len > bound:
                raise CorruptPayloadError(f"{what}: compressed length {comp_len} exceeds bound {bound}")
            comp = src.read(comp_len, f"{what} data")
            all_hashes.update(U64.pack(h))
            if flags & FLAG_SPARSE and man.kind != "delta":
                raise CorruptPayloadError(f"{what}: sparse frame in a full snapshot")
            yield FrameRecord(e, ci, off, raw_len, hdr, h, comp, raw_hash,
                              new_hash if flags & FLAG_NEW_HASH else None, bool(flags & FLAG_SPARSE))
    magic, count, fh, mh = TRAILER.unpack(src.read(TRAILER.size, "trailer"))
    if magic != END_MAGIC:
        raise CorruptPayloadError(f"trailer: bad magic {magic!r}")
    if count != man.total_frames or fh != all_hashes.intdigest() or mh != xxh3(man.raw_json):
        raise CorruptPayloadError("trailer: frame count or checksums do not match the frames/manifest read")
    if not src.at_end():
        raise CorruptPayloadError("payload: trailing bytes after the trailer")


class Change(NamedTuple):
    """One verified frame, staged until the whole payload verified: sparse (element indices + XOR words)
    or dense (XOR bytes of a delta, or the new bytes of a full snapshot)."""
    name: str
    offset: int
    raw_len: int
    itemsize: int
    delta: bool
    idx: np.ndarray | None
    vals: np.ndarray | None
    dense: np.ndarray | None

    def apply_to(self, chunk: np.ndarray) -> None:
        """Commit onto `chunk` (the target's bytes at this frame's offset): XOR for a delta, copy for full."""
        if self.idx is not None:
            chunk.view(_WORD[self.itemsize])[self.idx] ^= self.vals
        elif self.delta:
            xor_into(chunk, self.dense, chunk)
        else:
            chunk[...] = self.dense


def verify_record(rec: FrameRecord, delta: bool, base: np.ndarray | None) -> Change:
    """Verify and decompress one frame into a staged `Change`. When `base` (the receiver's bytes of this
    chunk) is given and the sender recorded the new bytes' checksum, the reconstruction is checked too."""
    where = f"tensor {rec.entry.name!r} frame {rec.index}"
    if xxh3_parts(rec.header, rec.data) != rec.checksum:
        raise CorruptPayloadError(f"{where}: frame checksum mismatch")
    itemsize = rec.entry.itemsize
    limit = rec.raw_len + 8 + 5 * (rec.raw_len // itemsize) if rec.sparse else rec.raw_len
    try:
        dec = _SCRATCH.dctx.decompress(rec.data, max_output_size=limit)
    except zstd.ZstdError as e:
        raise CorruptPayloadError(f"{where}: zstd error ({e})") from None
    if xxh3(dec) != rec.raw_hash:
        raise CorruptPayloadError(f"{where}: decoded-content checksum mismatch")
    stored = np.frombuffer(dec, dtype=np.uint8)
    if rec.sparse:
        if itemsize not in _WORD:
            raise CorruptPayloadError(f"{where}: sparse frame for a {itemsize}-byte dtype")
        idx, vals = unpack_sparse(stored, itemsize, rec.entry.shuffle, rec.raw_len // itemsize, where)
        ch = Change(rec.entry.name, rec.offset, rec.raw_len, itemsize, True, idx, vals, None)
    else:
        if len(dec) != rec.raw_len:
            raise CorruptPayloadError(f"{where}: decoded {len(dec)} bytes, manifest says {rec.raw_len}")
        width = rec.entry.shuffle
        raw = unshuffle_into(stored, width, np.empty(rec.raw_len, dtype=np.uint8)) if width > 1 else stored
        ch = Change(rec.entry.name, rec.offset, rec.raw_len, itemsize, delta, None, None, raw)
    if rec.new_hash is not None and (base is not None or not delta):
        new = ch.dense
        if delta:
            new = _SCRATCH.buf("new", rec.raw_len)
            new[...] = base
            ch.apply_to(new)
        if xxh3(new) != rec.new_hash:
            raise CorruptPayloadError(f"{where}: reconstructed-weights checksum mismatch (the receiver's base "
                                      f"bytes differ from the sender's base)")
    return ch


def decode_frames(src: _Source, man: Manifest, bases: dict[str, np.ndarray] | None,
                  threads: int | None = None) -> list[Change]:
    """Read, verify and stage every frame and the trailer of a payload whose manifest was read. `bases`
    (the receiver's bytes per tensor) enables the reconstruction check of deltas. Raises on any defect."""
    delta = man.kind == "delta"

    def tasks() -> Iterator[Callable[[], Change]]:
        for rec in iter_frame_records(src, man):
            base = bases[rec.entry.name][rec.offset:rec.offset + rec.raw_len] if bases is not None else None
            yield partial(verify_record, rec, delta, base)

    return list(pipeline(tasks(), threads or default_threads()))


def commit(changes: list[Change], targets: dict[str, np.ndarray], threads: int | None = None) -> None:
    """Apply verified changes onto the target tensors' bytes (in parallel over frames)."""
    tasks = (partial(ch.apply_to, targets[ch.name][ch.offset:ch.offset + ch.raw_len]) for ch in changes)
    for _ in pipeline(tasks, threads or default_threads()):
        pass
