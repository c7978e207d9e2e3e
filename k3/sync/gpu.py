"""GPU path of k3.sync: XOR on the device where the weights live (Triton), compression on the host.

Sender: for chunk k, a side stream runs the Triton XOR of new and base into device slot k % depth and copies
it to pinned host slot k % depth (for a delta it also copies the chunk's new bytes to a second pinned slot);
a host worker waits for that copy's event, then hashes, shuffles and compresses. Every frame records the
xxh3 of its new bytes (FLAG_NEW_HASH), as the CPU sender does, so a CUDA-encoded payload is byte-identical
to the CPU-encoded one and a receiver can check its reconstruction. Slots are recycled only after the chunk
`depth` places earlier was consumed (see `codec.pipeline`), so XOR, device-to-host copies and compression
of different chunks overlap. Cost of the new-bytes hash: one more device-to-host copy of each delta chunk
(the new weights, besides their XOR) and one xxh3 of it on the host workers.

Receiver (`cuda_apply`), what is verified where, all before anything is written to the live tensors:
  * host workers: the frame record checksum, the decoded-content checksum and the frame layout
    (`codec.verify_record`); for a full snapshot also the new bytes' xxh3 (the decoded bytes are the new
    bytes); then the dense XOR (delta) or new bytes (full) go into a pinned slot;
  * device (side stream): the slot is copied to the device and XORed with the live base into a device
    staging copy (the bytes that will be committed);
  * reconstruction check, for every delta frame that carries the new bytes' xxh3 (all frames of this
    version of the format): the staging bytes just reconstructed on the device are copied back to a pinned
    slot and a host worker compares their xxh3 with the record's, the same check the CPU receiver makes on
    its reconstruction. A delta applied to bytes that are not the sender's base (same version number,
    different bytes) fails it: CorruptPayloadError naming the tensor and frame;
  * the trailer (frame count, checksum of all frame checksums, manifest checksum) after the last frame.
Only then are the staging copies written over the live tensors; on any failure the live tensors are left
bitwise untouched (the side stream is drained before returning). Cost of the reconstruction check: one
device-to-host copy of every reconstructed byte (the whole model, per delta, queued on the side stream after
each chunk's XOR; it overlaps with the host workers' decoding of the next chunks) and one xxh3 per chunk
(about 14 GB/s per host thread) on a second pool of `threads` host threads, plus `depth` more pinned chunk
buffers. Measured on the H200 (benchmarks/weight_sync.py's 2 GiB bf16 state, 1% of values changed, 16 host
threads): CUDA receiver apply 6.1-6.3 GB/s without the check, 4.8-5.4 GB/s with it (median of 5 applies,
two runs each); a second stream for the read-back gained nothing measurable (the host side bounds it).
A delta frame without the new bytes' hash (written by an older CUDA sender) cannot be checked this way,
as on the CPU path.

`cuda_apply` also runs on CPU tensors (no streams or events; torch's XOR instead of the Triton kernel), so
the receiver logic above is tested without a GPU (tests/sync/test_gpu_path.py).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from functools import partial
from typing import Callable, Iterator

import numpy as np
import torch

from .codec import (FrameRecord, Piece, _Source, _frame_record, default_threads, verify_record,
                    iter_frame_records, pack_chunk, pipeline)
from .format import CorruptPayloadError, Manifest, SyncError, xxh3


def _xor_bytes():
    from k3_kernels.xor import xor_bytes

    return xor_bytes


def _torch_xor(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """XOR of two flat uint8 tensors into `out` (the CPU stand-in for the Triton kernel)."""
    return torch.bitwise_xor(a, b, out=out)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def cuda_tasks(plan, chunk_bytes: int, level: int, depth: int, sparse: bool) -> Iterator[Callable[[], list[Piece]]]:
    """Encoding tasks for CUDA tensors (plan entries: tensor, base or None, shuffle width, nbytes, frames)."""
    xor_bytes = _xor_bytes()
    device = plan[0][0].device
    stream = torch.cuda.Stream(device=device)
    dev = [torch.empty(chunk_bytes, dtype=torch.uint8, device=device) for _ in range(depth)]
    host = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(depth)]
    delta = plan[0][1] is not None  # iter_encode: all tensors have a base, or none has
    new_host = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(depth if delta else 0)]
    k = 0
    stream.wait_stream(torch.cuda.current_stream(device))
    for ti, (t, b, width, nbytes, frames) in enumerate(plan):
        if t.device != device:
            raise SyncError(f"tensor #{ti} is on {t.device}, others on {device}: put all tensors on one device")
        tb, bb = _flat(t), (_flat(b) if b is not None else None)
        for ci in range(frames):
            off = ci * chunk_bytes
            n = min(chunk_bytes, nbytes - off)
            slot = k % depth
            k += 1
            new = None
            with torch.cuda.stream(stream):
                src = tb[off:off + n]
                if bb is not None:
                    new = new_host[slot][:n]
                    new.copy_(src, non_blocking=True)
                    src = xor_bytes(src, bb[off:off + n], out=dev[slot][:n])
                host[slot][:n].copy_(src, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
            yield partial(_host_compress, ev, host[slot][:n].numpy(), None if new is None else new.numpy(), ti, ci,
                          off, width, t.element_size(), bb is not None, level, sparse)


def _host_compress(ev: torch.cuda.Event, raw: np.ndarray, new: np.ndarray | None, ti: int, ci: int, off: int,
                   width: int, itemsize: int, delta: bool, level: int, sparse: bool) -> list[Piece]:
    """Hash the new bytes (`new` for a delta, `raw` itself for a full snapshot), pack and compress `raw`."""
    ev.synchronize()
    new_hash = xxh3(raw if new is None else new)
    stored, is_sparse = pack_chunk(raw, width, itemsize, delta, sparse)
    return _frame_record(ti, ci, off, raw.size, stored, new_hash, level, is_sparse)


def _host_decode(rec: FrameRecord, delta: bool, ev: torch.cuda.Event | None, dst: np.ndarray) -> FrameRecord:
    """Verify a frame and write its dense XOR bytes (delta) or new bytes (full) into pinned slot `dst`.

    The base is on the device, so a delta's reconstruction is checked there (`cuda_apply`), not here; a full
    snapshot's new-bytes hash is checked here (its decoded bytes are the new bytes)."""
    ch = verify_record(rec, delta, None)
    if ev is not None:
        ev.synchronize()  # the previous host->device copy out of this slot has finished
    if ch.dense is None or ch.delta:
        dst[...] = 0
        ch = ch._replace(delta=True)
    ch.apply_to(dst)
    return rec


def _check_reconstructed(ev: torch.cuda.Event | None, got: np.ndarray, rec: FrameRecord) -> None:
    """Host side of the reconstruction check: wait for the device->host copy of the reconstructed bytes of
    `rec`'s chunk, then compare their xxh3 with the new bytes' hash the sender recorded."""
    if ev is not None:
        ev.synchronize()
    if xxh3(got) != rec.new_hash:
        raise CorruptPayloadError(f"tensor {rec.entry.name!r} frame {rec.index}: reconstructed-weights checksum "
                                  f"mismatch (the receiver's base bytes differ from the sender's base)")


def _on(stream: torch.cuda.Stream | None):
    return torch.cuda.stream(stream) if stream is not None else nullcontext()


def _recorded_event(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    if stream is None:
        return None
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


def cuda_apply(state: dict[str, torch.Tensor], src: _Source, man: Manifest, threads: int | None) -> None:
    """Decode a payload (manifest already checked) into device staging, verify it (the reconstructed bytes
    included), then overwrite `state` in place; on any failure `state` is untouched. CUDA tensors; CPU
    tensors run the same steps synchronously (tests)."""
    threads = threads or default_threads()
    depth = 2 * threads
    delta = man.kind == "delta"
    device = next(iter(state.values())).device
    on_cuda = device.type == "cuda"
    xor_bytes = _xor_bytes() if on_cuda else _torch_xor
    stream = torch.cuda.Stream(device=device) if on_cuda else None
    host = [torch.empty(man.chunk_bytes, dtype=torch.uint8, pin_memory=on_cuda) for _ in range(depth)]
    back = [torch.empty(man.chunk_bytes, dtype=torch.uint8, pin_memory=on_cuda) for _ in range(depth if delta else 0)]
    dev = [torch.empty(man.chunk_bytes, dtype=torch.uint8, device=device) for _ in range(depth)]
    events: list[torch.cuda.Event | None] = [None] * depth
    checks: list[tuple[int, Future] | None] = [None] * depth  # reconstruction check reading back[slot]
    staged = {e.name: torch.empty_like(state[e.name]) for e in man.tensors}

    def tasks() -> Iterator[Callable[[], FrameRecord]]:
        for k, rec in enumerate(iter_frame_records(src, man)):
            slot = k % depth
            yield partial(_host_decode, rec, delta, events[slot], host[slot][:rec.raw_len].numpy())

    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(device))
    frames = pipeline(tasks(), threads, depth)
    try:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="k3sync-check") as checker:
            try:
                for k, rec in enumerate(frames):
                    slot, n, off = k % depth, rec.raw_len, rec.offset
                    if checks[slot] is not None:  # chunk k - depth: its check must be done before back[slot] is reused
                        checks[slot][1].result()
                        checks[slot] = None
                    with _on(stream):
                        d = dev[slot][:n]
                        d.copy_(host[slot][:n], non_blocking=True)
                        out = _flat(staged[rec.entry.name])[off:off + n]
                        if delta:
                            xor_bytes(_flat(state[rec.entry.name])[off:off + n], d, out=out)
                            if rec.new_hash is not None:
                                back[slot][:n].copy_(out, non_blocking=True)
                        else:
                            out.copy_(d)
                        ev = _recorded_event(stream)
                    events[slot] = ev
                    if delta and rec.new_hash is not None:
                        checks[slot] = (k, checker.submit(_check_reconstructed, ev, back[slot][:n].numpy(), rec))
                for _, f in sorted((c for c in checks if c is not None), key=lambda c: c[0]):  # in frame order
                    f.result()
            finally:
                for c in checks:
                    if c is not None:
                        c[1].cancel()
                frames.close()  # on failure: stop the decode workers before the buffers go
        with _on(stream):  # commit: every frame, every reconstruction and the trailer verified
            for name, t in staged.items():
                state[name].copy_(t)
    finally:
        if stream is not None:
            stream.synchronize()  # nothing left in flight on the buffers (also after a failure)
