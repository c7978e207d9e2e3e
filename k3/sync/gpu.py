"""GPU path of k3.sync: XOR on the device where the weights live (Triton), compression on the host.

Sender: for chunk k, a side stream runs the Triton XOR of new and base into device slot k % depth and copies
it to pinned host slot k % depth; a host worker waits for that copy's event, then shuffles, hashes and
compresses. Slots are recycled only after the chunk `depth` places earlier was consumed (see
`codec.pipeline`), so XOR, device-to-host copy and compression of different chunks overlap.
Receiver: host workers verify and decompress frames into pinned slots; the calling thread copies each slot
to the device and XORs it with the live base into a device staging copy; the live tensors are overwritten
only after the whole payload (trailer included) verified.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Iterator

import numpy as np
import torch

from .codec import (FrameRecord, Piece, _Source, _frame_record, default_threads, verify_record,
                    iter_frame_records, pack_chunk, pipeline)
from .format import Manifest, SyncError


def _xor_bytes():
    from k3_kernels.xor import xor_bytes

    return xor_bytes


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def cuda_tasks(plan, chunk_bytes: int, level: int, depth: int, sparse: bool) -> Iterator[Callable[[], list[Piece]]]:
    """Encoding tasks for CUDA tensors (plan entries: tensor, base or None, shuffle width, nbytes, frames)."""
    xor_bytes = _xor_bytes()
    device = plan[0][0].device
    stream = torch.cuda.Stream(device=device)
    dev = [torch.empty(chunk_bytes, dtype=torch.uint8, device=device) for _ in range(depth)]
    host = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(depth)]
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
            with torch.cuda.stream(stream):
                src = tb[off:off + n]
                if bb is not None:
                    src = xor_bytes(src, bb[off:off + n], out=dev[slot][:n])
                host[slot][:n].copy_(src, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
            yield partial(_host_compress, ev, host[slot][:n].numpy(), ti, ci, off, width, t.element_size(),
                          bb is not None, level, sparse)


def _host_compress(ev: torch.cuda.Event, raw: np.ndarray, ti: int, ci: int, off: int, width: int, itemsize: int,
                   delta: bool, level: int, sparse: bool) -> list[Piece]:
    ev.synchronize()
    stored, is_sparse = pack_chunk(raw, width, itemsize, delta, sparse)
    return _frame_record(ti, ci, off, raw.size, stored, None, level, is_sparse)


def _host_decode(rec: FrameRecord, delta: bool, ev: torch.cuda.Event | None, dst: np.ndarray) -> FrameRecord:
    """Verify a frame and write its dense XOR bytes (delta) or new bytes (full) into pinned slot `dst`."""
    ch = verify_record(rec, delta, None)
    if ev is not None:
        ev.synchronize()  # the previous host->device copy out of this slot has finished
    if ch.dense is None or ch.delta:
        dst[...] = 0
        ch = ch._replace(delta=True)
    ch.apply_to(dst)
    return rec


def cuda_apply(state: dict[str, torch.Tensor], src: _Source, man: Manifest, threads: int | None) -> None:
    """Decode a payload (manifest already checked) into device staging, then overwrite `state` in place."""
    xor_bytes = _xor_bytes()
    threads = threads or default_threads()
    depth = 2 * threads
    device = next(iter(state.values())).device
    stream = torch.cuda.Stream(device=device)
    host = [torch.empty(man.chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(depth)]
    dev = [torch.empty(man.chunk_bytes, dtype=torch.uint8, device=device) for _ in range(depth)]
    events: list[torch.cuda.Event | None] = [None] * depth
    staged = {e.name: torch.empty_like(state[e.name]) for e in man.tensors}

    def tasks() -> Iterator[Callable[[], FrameRecord]]:
        for k, rec in enumerate(iter_frame_records(src, man)):
            slot = k % depth
            yield partial(_host_decode, rec, man.kind == "delta", events[slot], host[slot][:rec.raw_len].numpy())

    stream.wait_stream(torch.cuda.current_stream(device))
    for k, rec in enumerate(pipeline(tasks(), threads, depth)):
        slot, n, off = k % depth, rec.raw_len, rec.offset
        with torch.cuda.stream(stream):
            d = dev[slot][:n]
            d.copy_(host[slot][:n], non_blocking=True)
            out = _flat(staged[rec.entry.name])[off:off + n]
            if man.kind == "delta":
                xor_bytes(_flat(state[rec.entry.name])[off:off + n], d, out=out)
            else:
                out.copy_(d)
            ev = torch.cuda.Event()
            ev.record(stream)
            events[slot] = ev
    stream.synchronize()
    with torch.cuda.stream(stream):  # commit: everything verified
        for name, t in staged.items():
            state[name].copy_(t)
    stream.synchronize()
