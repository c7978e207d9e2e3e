"""The CUDA all-reduce over torch symmetric memory (`torch.distributed._symmetric_memory`): every rank's staging
buffer is mapped into every peer's address space (NVLink P2P), and peer_sum's Triton kernels read the peers'
buffers directly (at their `_SymmetricMemory.buffer_ptrs` addresses, as element deltas from this rank's) and
meet the peers' programs through the handle's signal pads (`signal_pad_ptrs`).

Per rank, one symmetric uint8 buffer of 2 slots (double buffering by call parity); a slot holds the input region
(the caller's tensor, copied in by the kernel) and the reduced-shard region (two-shot's stage 1 output).

    one-shot, call k (slot k % 2):  copy x -> input[slot]; meet; out = sum_r peer_r.input[slot]
    two-shot, call k:               copy x -> input[slot]; meet; shard[slot] = sum_r peer_r.input[slot][my shard];
                                    meet; out = concat_s peer_s.shard[slot]

(Sync.IN_KERNEL: one launch, "meet" = peer_sum._meet; Sync.HOST_BARRIER: one launch per stage, "meet" = torch's
`_SymmetricMemory.barrier` on the current stream, the pattern torch's `_low_contention_all_gather` uses.)
No trailing meeting: call k + 1 uses the other slot, and a rank writes slot k % 2 again only in call k + 2, after
its call k + 1 met every peer's call k + 1, which no peer starts before finishing call k (stream order). So every
call on a group runs on one stream per rank, in the same order on every rank, with the same size (checked when
AllReduceConfig.check_across_ranks). NVLink multicast (multimem) is not used."""
from __future__ import annotations

import torch
import torch.distributed._symmetric_memory as symm

from k3_kernels.launch import num_sms

from . import peer_sum
from .plan import Algorithm, AllReduceConfig, Sync, shard_size

_MIN_CAPACITY = 1 << 20
_SLOTS = 2


class Workspace:
    """The symmetric staging buffer of one (group, device): `capacity` bytes of input and of reduced shard per slot.
    Created (collectively: every rank at the same call) on first use and regrown to the next power of two when a
    larger message comes; a replaced buffer is kept alive (peers may still hold its mapping), at most a few."""

    def __init__(self, group, device: torch.device, capacity: int):
        self.capacity = capacity
        self.slot_bytes = 2 * capacity
        self.buffer = symm.empty(_SLOTS * self.slot_bytes, dtype=torch.uint8, device=device)
        self.handle = symm.rendezvous(self.buffer, group.group_name)
        self.rank, self.world = self.handle.rank, self.handle.world_size
        # buffer_ptrs are the bases of the peers' mapped blocks; a tensor from torch's symmetric memory pool may
        # start inside its block (torch >= 2.10 keeps that offset in the handle), at the same offset on every rank.
        bases = list(self.handle.buffer_ptrs)
        offset = self.buffer.data_ptr() - bases[self.rank]
        if not 0 <= offset < self.handle.buffer_size:
            raise RuntimeError(f"all_reduce: symmetric buffer at offset {offset} of its block (outside it)")
        self.bases = [b + offset for b in bases]
        self._views: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pads = torch.tensor(list(self.handle.signal_pad_ptrs), dtype=torch.int64, device=device)
        # program p uses int32 signal slots [p W, (p + 1) W) of every pad; one program per SM at most, all resident
        # (a program spinning for a peer's program that cannot be scheduled would hang).
        pad_bytes = getattr(self.handle, "signal_pad_size", None) or self.handle.get_signal_pad(self.rank).nbytes
        self.max_programs = max(1, min(num_sms(device), pad_bytes // (4 * self.world)))
        self.calls = 0

    def view(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's buffer as `dtype` and the peers' element deltas from it (peer_sum's addressing)."""
        if dtype not in self._views:
            deltas = peer_sum.peer_deltas(self.bases, self.rank, dtype.itemsize)
            self._views[dtype] = (self.buffer.view(dtype),
                                  torch.tensor(deltas, dtype=torch.int64, device=self.buffer.device))
        return self._views[dtype]

    def next_slot(self) -> int:
        slot = self.calls % _SLOTS
        self.calls += 1
        return slot

    def input_offset(self, slot: int, element_size: int) -> int:
        return slot * self.slot_bytes // element_size

    def shard_offset(self, slot: int, element_size: int) -> int:
        return (slot * self.slot_bytes + self.capacity) // element_size


_workspaces: dict[tuple, Workspace] = {}  # (group, device index) -> its workspace
_retired: list[Workspace] = []


def workspace(group, device: torch.device, nbytes: int) -> Workspace:
    """The group's workspace on `device`, at least `nbytes` per region (collective when it is created or grown)."""
    key = (group, device.index)
    ws = _workspaces.get(key)
    if ws is None or ws.capacity < nbytes:
        capacity = max(_MIN_CAPACITY, 1 << max(0, nbytes - 1).bit_length())
        if ws is not None:
            ws.handle.barrier(channel=0)  # every peer is past its last call on the old buffer
            _retired.append(ws)
        try:
            ws = Workspace(group, device, capacity)
        except RuntimeError as e:
            raise RuntimeError(f"all_reduce: symmetric memory rendezvous failed on {device} ({e}); pass "
                               f"AllReduceConfig(use_symmetric_memory=False) for the process-group path") from e
        _workspaces[key] = ws
    return ws


class _Plan:
    """Everything of one call shape (group, dtype, numel, algorithm, sync) that does not change between calls: the
    launch arguments of both slots (the per-call host time is what one-shot's latency is made of)."""

    def __init__(self, ws: Workspace, dtype: torch.dtype, n: int, algorithm: Algorithm, config: AllReduceConfig):
        self.ws, self.host = ws, config.sync is Sync.HOST_BARRIER
        self.one_shot = algorithm is Algorithm.ONE_SHOT
        es = dtype.itemsize
        buf, deltas = ws.view(dtype)
        if self.one_shot:
            programs = peer_sum.programs_for(peer_sum.one_shot_blocks(n), ws.max_programs)
            self.slots = [(buf, deltas, ws.pads, ws.input_offset(s, es)) for s in range(_SLOTS)]
            self.tail = (ws.rank, programs)
        else:
            shard = shard_size(n, ws.world, es, config)
            programs = peer_sum.programs_for(peer_sum.two_shot_blocks(shard), ws.max_programs)
            self.slots = [(buf, deltas, ws.pads, ws.input_offset(s, es), ws.shard_offset(s, es))
                          for s in range(_SLOTS)]
            self.tail = (shard, ws.rank, programs)

    def run(self, flat: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(flat)
        args = (flat, *self.slots[self.ws.next_slot()], out, *self.tail)
        if self.one_shot:
            if not self.host:
                peer_sum.one_shot(*args)
                return out
            peer_sum.one_shot(*args, reduce=False, sync=False)
            self.ws.handle.barrier(channel=0)
            peer_sum.one_shot(*args, copy_in=False, sync=False)
            return out
        if not self.host:
            peer_sum.two_shot(*args)
            return out
        peer_sum.two_shot(*args, reduce=False, gather=False, sync=False)
        self.ws.handle.barrier(channel=0)
        peer_sum.two_shot(*args, copy_in=False, gather=False, sync=False)
        self.ws.handle.barrier(channel=0)
        peer_sum.two_shot(*args, copy_in=False, reduce=False, sync=False)
        return out


_plans: dict[tuple, _Plan] = {}


def all_reduce_symm_mem(flat: torch.Tensor, group, algorithm: Algorithm, config: AllReduceConfig) -> torch.Tensor:
    """Ordered sum of every rank's contiguous 1-D CUDA `flat` (same numel and dtype everywhere, checked before)."""
    n = flat.numel()
    key = (group, flat.device.index, flat.dtype, n, algorithm, config.sync, config.shard_align_bytes)
    plan = _plans.get(key)
    if plan is None or plan.ws is not _workspaces.get(key[:2]):
        plan = _plans[key] = _Plan(workspace(group, flat.device, n * flat.element_size()), flat.dtype, n,
                                   algorithm, config)
    return plan.run(flat)
