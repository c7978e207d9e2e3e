"""Triton kernels of the symmetric-memory all-reduce. They reach every rank's buffer from this rank's (one
int64 element delta per rank, rank order) and sum element i over ranks 0..W-1 in that order in fp32, rounding once: the
order of naive.py (the tests check it bit for bit, on CPU in Triton's interpreter over per-rank buffers of one
process, and on 2+ GPUs over symmetric memory).

Work partition (the same on every rank, so that peers' programs with the same id touch the same blocks):
* one-shot: program p owns blocks b = p, p + P, ... of BLOCK elements of the message;
* two-shot: program p owns shard-local blocks j = p, p + P, ... of every shard (shard s = [s S, (s + 1) S)).
Stages, each switched by a constexpr so the interpreter can run them rank after rank:
  COPY_IN:  the caller's x -> this rank's input region (program p copies exactly the blocks peers' program p reads)
  REDUCE:   one-shot: out[b] = sum_r peer_r.input[b];  two-shot: my shard region[j] = sum_r peer_r.input[my shard, j]
  GATHER:   two-shot: out[s S + j] = peer_s.shard[j]
With SYNC, program p meets program p of every peer (`_meet`) after COPY_IN and after REDUCE: it signals each peer's
int32 signal pad slot [p W + rank] (compare-and-swap 0 -> 1, release, system scope; it retries while the peer has
not yet consumed the previous signal) and consumes its own slots [p W + q] (1 -> 0, acquire), one thread per peer,
all peers at once. Block-level barriers (bar.sync) order the other threads' accesses around those signals (the
pattern of torch's own symmetric-memory kernels). Peers' buffers are read with ld.global.cg (L2, not the SM's L1:
a slot is read again two calls later and must not come from a stale L1 line). No multimem instructions (NVLink
multicast stays off)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3_kernels.launch import CachedLaunch, cdiv, next_pow2

BLOCK = 2048
NUM_WARPS = 8


@triton.jit
def _peer(buf_ptr, deltas, rank):
    """Rank `rank`'s buffer: this rank's buffer moved by deltas[rank] elements. (Pointer arithmetic on the local
    buffer keeps its alignment known, so Triton vectorises the peer loads; an address turned into a pointer does
    not. The deltas are multiples of 16 elements: symmetric buffers are 2 MiB-granular mappings.)"""
    return buf_ptr + tl.multiple_of(tl.load(deltas + rank), 16)


@triton.jit
def _pad(pads, rank):
    """Rank `rank`'s signal pad (int32 slots)."""
    return tl.load(pads + rank).to(tl.pointer_type(tl.int32))


@triton.jit
def _meet(pads, pid, rank, W: tl.constexpr, WP: tl.constexpr):
    """Program `pid` of this rank and program `pid` of every peer pass this point together; writes before it (any
    thread of the block) are visible to the peers' reads after it. Lane q (one thread each, q < W, q != rank)
    signals peer q and then consumes peer q's signal, all peers at once; a lane that is done (or is this rank, or
    is padding up to WP = next power of two of W) compares and swaps -1 with -1, which never writes."""
    tl.debug_barrier()
    q = tl.arange(0, WP)
    peer_pads = tl.load(pads + q, mask=q < W, other=0).to(tl.pointer_type(tl.int32))
    own_pad = _pad(pads, rank)
    pending = (q < W) & (q != rank)
    send = tl.where(pending, peer_pads + pid * W + rank, own_pad + pid * W + rank)
    while tl.sum(pending.to(tl.int32), axis=0) > 0:
        old = tl.atomic_cas(send, tl.where(pending, 0, -1), tl.where(pending, 1, -1), sem="release", scope="sys")
        pending = pending & (old != 0)
    pending = (q < W) & (q != rank)
    recv = own_pad + pid * W + tl.where(q < W, q, rank)
    while tl.sum(pending.to(tl.int32), axis=0) > 0:
        old = tl.atomic_cas(recv, tl.where(pending, 1, -1), tl.where(pending, 0, -1), sem="acquire", scope="sys")
        pending = pending & (old != 1)
    tl.debug_barrier()


@triton.jit
def _one_shot_kernel(x_ptr, buf_ptr, deltas, pads, in_offset, out_ptr, n, rank, W: tl.constexpr, WP: tl.constexpr,
                     BLOCK: tl.constexpr,
                     COPY_IN: tl.constexpr, REDUCE: tl.constexpr, SYNC: tl.constexpr):
    ty = out_ptr.dtype.element_ty
    pid, P = tl.program_id(0), tl.num_programs(0)
    nblk = tl.cdiv(n, BLOCK)
    lanes = tl.arange(0, BLOCK)
    if COPY_IN:
        local = buf_ptr + in_offset
        for b in range(pid, nblk, P):
            i = tl.cast(b, tl.int64) * BLOCK + lanes
            tl.store(local + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)
    if SYNC:
        _meet(pads, pid, rank, W, WP)
    if REDUCE:
        for b in range(pid, nblk, P):
            i = tl.cast(b, tl.int64) * BLOCK + lanes
            mask = i < n
            acc = tl.load(_peer(buf_ptr, deltas, 0) + in_offset + i, mask=mask, other=0.0, cache_modifier=".cg")
            acc = acc.to(tl.float32)
            for r in tl.static_range(1, W):
                acc += tl.load(_peer(buf_ptr, deltas, r) + in_offset + i, mask=mask, other=0.0,
                               cache_modifier=".cg").to(tl.float32)
            tl.store(out_ptr + i, acc.to(ty), mask=mask)


@triton.jit
def _two_shot_kernel(x_ptr, buf_ptr, deltas, pads, in_offset, shard_offset, out_ptr, n, shard, rank, W: tl.constexpr,
                     WP: tl.constexpr,
                     BLOCK: tl.constexpr, COPY_IN: tl.constexpr, REDUCE: tl.constexpr, GATHER: tl.constexpr,
                     SYNC: tl.constexpr):
    ty = out_ptr.dtype.element_ty
    pid, P = tl.program_id(0), tl.num_programs(0)
    nblk = tl.cdiv(shard, BLOCK)
    lanes = tl.arange(0, BLOCK)
    if COPY_IN:
        local = buf_ptr + in_offset
        for j in range(pid, nblk, P):
            jj = tl.cast(j, tl.int64) * BLOCK + lanes
            for s in tl.static_range(W):
                i = s * shard + jj
                m = (jj < shard) & (i < n)
                tl.store(local + i, tl.load(x_ptr + i, mask=m), mask=m)
    if SYNC:
        _meet(pads, pid, rank, W, WP)
    if REDUCE:
        mine = buf_ptr + shard_offset
        for j in range(pid, nblk, P):
            jj = tl.cast(j, tl.int64) * BLOCK + lanes
            i = rank * shard + jj
            m = (jj < shard) & (i < n)
            acc = tl.load(_peer(buf_ptr, deltas, 0) + in_offset + i, mask=m, other=0.0, cache_modifier=".cg")
            acc = acc.to(tl.float32)
            for r in tl.static_range(1, W):
                acc += tl.load(_peer(buf_ptr, deltas, r) + in_offset + i, mask=m, other=0.0,
                               cache_modifier=".cg").to(tl.float32)
            tl.store(mine + jj, acc.to(ty), mask=m)
    if SYNC:
        _meet(pads, pid, rank, W, WP)
    if GATHER:
        for j in range(pid, nblk, P):
            jj = tl.cast(j, tl.int64) * BLOCK + lanes
            for s in tl.static_range(W):
                i = s * shard + jj
                m = (jj < shard) & (i < n)
                v = tl.load(_peer(buf_ptr, deltas, s) + shard_offset + jj, mask=m, cache_modifier=".cg")
                tl.store(out_ptr + i, v, mask=m)


_launch_one_shot = CachedLaunch(_one_shot_kernel)
_launch_two_shot = CachedLaunch(_two_shot_kernel)


def peer_deltas(bases: list[int], rank: int, element_size: int) -> list[int]:
    """deltas[q] = (rank q's buffer address - this rank's) in elements, each a multiple of 16 elements."""
    out = []
    for q, b in enumerate(bases):
        d, rest = divmod(b - bases[rank], element_size)
        if rest or d % 16:
            raise ValueError(f"rank {q}'s buffer is not 16-element aligned relative to rank {rank}'s")
        out.append(d)
    return out


def one_shot(x: torch.Tensor, buf: torch.Tensor, deltas: torch.Tensor, pads: torch.Tensor, in_offset: int,
             out: torch.Tensor, rank: int,
             programs: int, *, copy_in: bool = True, reduce: bool = True, sync: bool = True,
             block: int = BLOCK) -> None:
    """Stages of the one-shot all-reduce of this rank (`programs` = P: the same on every rank). x, out: contiguous,
    n elements; buf: this rank's buffer in x's dtype; deltas: peer_deltas of the buffers; pads: the signal pads'
    addresses; in_offset: the input region's element offset in every rank's buffer; block: elements per block
    (a power of two; smaller ones let the interpreter tests reach the persistent loops cheaply)."""
    world = deltas.numel()
    _launch_one_shot((programs,), x, buf, deltas, pads, in_offset, out, out.numel(), rank, W=world, WP=next_pow2(world),
                     BLOCK=block,
                     COPY_IN=copy_in, REDUCE=reduce, SYNC=sync, num_warps=NUM_WARPS)


def two_shot(x: torch.Tensor, buf: torch.Tensor, deltas: torch.Tensor, pads: torch.Tensor, in_offset: int,
             shard_offset: int, out: torch.Tensor, shard: int, rank: int, programs: int, *, copy_in: bool = True,
             reduce: bool = True,
             gather: bool = True, sync: bool = True, block: int = BLOCK) -> None:
    """Stages of the two-shot all-reduce of this rank; `shard` = plan.shard_size (elements per shard), shard_offset:
    the reduced-shard region's element offset in every rank's buffer."""
    world = deltas.numel()
    _launch_two_shot((programs,), x, buf, deltas, pads, in_offset, shard_offset, out, out.numel(), shard, rank, W=world,
                     WP=next_pow2(world), BLOCK=block, COPY_IN=copy_in, REDUCE=reduce, GATHER=gather, SYNC=sync,
                     num_warps=NUM_WARPS)


def programs_for(blocks: int, max_programs: int) -> int:
    """Grid size: one program per block up to `max_programs` (persistent beyond), at least one."""
    return max(1, min(blocks, max_programs))


def one_shot_blocks(n: int) -> int:
    return cdiv(n, BLOCK)


def two_shot_blocks(shard: int) -> int:
    return cdiv(shard, BLOCK)
