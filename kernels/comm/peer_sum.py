"""Triton kernels of the symmetric-memory all-reduce: they read the peers' buffers through a pointer table (one
int64 address per rank, rank order) and sum element i over ranks 0..W-1 in that order in fp32, rounding once, which
is naive.py's order (the tests check it bit for bit, on CPU in Triton's interpreter over per-rank buffers of one
process, and on 2+ GPUs over symmetric memory).

Offsets are in elements of the tensor's dtype from each rank's buffer base. The kernels only compute; the
synchronisation (every peer's input written before a read, no overwrite before every read) is the caller's
(symm_mem.py). No atomics, no multimem instructions (NVLink multicast stays off)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3_kernels.launch import CachedLaunch, cdiv

BLOCK = 2048


@triton.jit
def _peer(ptrs, rank, ty: tl.constexpr):
    """Rank `rank`'s buffer base as a pointer to `ty`."""
    return tl.load(ptrs + rank).to(tl.pointer_type(ty))


@triton.jit
def _one_shot_kernel(ptrs, in_offset, out_ptr, n, W: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = round(sum_{r=0..W-1} fp32(peer_r[in_offset + i])) for this program's block of i."""
    ty = out_ptr.dtype.element_ty
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.load(_peer(ptrs, 0, ty) + in_offset + offs, mask=mask, other=0.0).to(tl.float32)
    for r in tl.static_range(1, W):
        acc += tl.load(_peer(ptrs, r, ty) + in_offset + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(ty), mask=mask)


@triton.jit
def _reduce_shard_kernel(ptrs, in_offset, shard_ptr, start, end, W: tl.constexpr, BLOCK: tl.constexpr):
    """Two-shot stage 1 on one rank: shard[j] = round(sum_r fp32(peer_r[in_offset + start + j])), start + j < end."""
    ty = shard_ptr.dtype.element_ty
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    i = start + j
    mask = i < end
    acc = tl.load(_peer(ptrs, 0, ty) + in_offset + i, mask=mask, other=0.0).to(tl.float32)
    for r in tl.static_range(1, W):
        acc += tl.load(_peer(ptrs, r, ty) + in_offset + i, mask=mask, other=0.0).to(tl.float32)
    tl.store(shard_ptr + j, acc.to(ty), mask=mask)


@triton.jit
def _gather_shards_kernel(ptrs, shard_offset, out_ptr, n, shard, BLOCK: tl.constexpr):
    """Two-shot stage 2: out[s * shard + j] = peer_s[shard_offset + j] for program (s, block of j)."""
    ty = out_ptr.dtype.element_ty
    s = tl.program_id(0)
    j = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    i = s.to(tl.int64) * shard + j
    mask = (j < shard) & (i < n)
    v = tl.load(_peer(ptrs, s, ty) + shard_offset + j, mask=mask, other=0.0)
    tl.store(out_ptr + i, v, mask=mask)


_launch_one_shot = CachedLaunch(_one_shot_kernel)
_launch_reduce_shard = CachedLaunch(_reduce_shard_kernel)
_launch_gather_shards = CachedLaunch(_gather_shards_kernel)


def _check_table(ptrs: torch.Tensor) -> int:
    if ptrs.dtype != torch.int64 or ptrs.dim() != 1 or not ptrs.is_contiguous():
        raise ValueError(f"ptrs must be a contiguous 1-D int64 pointer table, got {ptrs.dtype}{list(ptrs.shape)}")
    return ptrs.numel()


def one_shot(ptrs: torch.Tensor, in_offset: int, out: torch.Tensor) -> None:
    """out (contiguous, n elements) = ordered sum of every rank's n elements at `in_offset` of its buffer."""
    world, n = _check_table(ptrs), out.numel()
    if n:
        _launch_one_shot((cdiv(n, BLOCK),), ptrs, in_offset, out, n, W=world, BLOCK=BLOCK, num_warps=8)


def reduce_shard(ptrs: torch.Tensor, in_offset: int, shard_out: torch.Tensor, start: int, end: int) -> None:
    """shard_out[:end - start] = ordered sum over ranks of elements [start, end) at `in_offset` (stage 1)."""
    world = _check_table(ptrs)
    if end > start:
        _launch_reduce_shard((cdiv(end - start, BLOCK),), ptrs, in_offset, shard_out, start, end, W=world,
                             BLOCK=BLOCK, num_warps=8)


def gather_shards(ptrs: torch.Tensor, shard_offset: int, out: torch.Tensor, shard: int) -> None:
    """out[s * shard + j] = rank s's reduced element j at `shard_offset` (stage 2; n = out.numel())."""
    world, n = _check_table(ptrs), out.numel()
    if n:
        _launch_gather_shards((world, cdiv(shard, BLOCK)), ptrs, shard_offset, out, n, shard, BLOCK=BLOCK,
                              num_warps=8)
