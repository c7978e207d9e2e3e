"""Two-tier pools with explicit budgets: fixed-size MLA latent-KV pages and KDA state slots.

Items (pages, states) have logical ids; each lives in a device slot or a host slot. Running sequences pin the
items they compute with (pinned items stay on the device); unpinned items (held by the prefix tree only) spill
to the host tier when the device is full and are restored on use. When the host tier is full too, the pool asks
its `reclaimer` (the prefix cache) to drop something. Reference counts decide when an item is freed.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


class PoolExhausted(RuntimeError):
    """Every device slot is pinned by running sequences and nothing can be spilled or dropped."""


@dataclass
class _Item:
    tier: str          # "device" | "host"
    slot: int
    ref: int = 1
    pin: int = 0
    last_used: int = 0


class TieredPool:
    """`shapes`: name -> (per-item shape, dtype). Device storage `dev[name]` is [device_capacity + spare, *shape]:
    the last `spare` rows (`spare_slots`) belong to no item and are never allocated -- scratch rows a fixed-shape
    forward points its idle seats at (k3.rollout.graphs), outside the pool's accounting."""

    def __init__(self, name: str, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], device_capacity: int,
                 host_capacity: int, device: torch.device | str, spare: int = 0):
        if device_capacity < 1:
            raise ValueError(f"{name}: device capacity must be >= 1, got {device_capacity}")
        if host_capacity < 0:
            raise ValueError(f"{name}: host capacity must be >= 0, got {host_capacity}")
        if spare < 0:
            raise ValueError(f"{name}: spare slots must be >= 0, got {spare}")
        self.name = name
        self.device = torch.device(device)
        self.dev = {k: torch.zeros((device_capacity + spare, *s), dtype=dt, device=self.device)
                    for k, (s, dt) in shapes.items()}
        self.spare_slots = range(device_capacity, device_capacity + spare)
        pin = self.device.type == "cuda"
        self.host = {k: torch.zeros((host_capacity, *s), dtype=dt, pin_memory=pin) for k, (s, dt) in shapes.items()}
        self.free = {"device": list(range(device_capacity - 1, -1, -1)), "host": list(range(host_capacity - 1, -1, -1))}
        self.capacity = {"device": device_capacity, "host": host_capacity}
        self.items: dict[int, _Item] = {}
        self._next_id = 0
        self.clock = 0
        # reclaimer(tier): the cache drops its LRU holder of unpinned items on `tier`; False if it has none
        self.reclaimer: Callable[[str], bool] | None = None
        self.stats = {"spills": 0, "restores": 0, "allocs": 0}
        self.item_bytes = sum(int(torch.tensor([], dtype=dt).element_size()) * int(torch.Size(s).numel())
                              for s, dt in shapes.values())

    # ------------------------------------------------------------------ bookkeeping
    def used(self, tier: str) -> int:
        return self.capacity[tier] - len(self.free[tier])

    def touch(self, i: int) -> None:
        self.clock += 1
        self.items[i].last_used = self.clock

    def slot(self, i: int) -> int:
        it = self.items[i]
        if it.tier != "device":
            raise RuntimeError(f"{self.name}: item {i} is on the host; restore it first")
        return it.slot

    # ------------------------------------------------------------------ alloc / free
    def alloc(self) -> int:
        """A new item on the device (ref 1, pinned once: the caller computes with it)."""
        slot = self._device_slot()
        i = self._next_id
        self._next_id += 1
        self.items[i] = _Item("device", slot, ref=1, pin=1)
        self.touch(i)
        self.stats["allocs"] += 1
        return i

    def copy(self, src: int) -> int:
        """Copy-on-write: a new pinned device item with `src`'s content."""
        self.ensure_device(src)
        self.items[src].pin += 1  # keep src on the device while allocating
        try:
            dst = self.alloc()
        finally:
            self.items[src].pin -= 1
        s, d = self.items[src].slot, self.items[dst].slot
        for k in self.dev:
            self.dev[k][d].copy_(self.dev[k][s])
        return dst

    def incref(self, i: int) -> None:
        self.items[i].ref += 1

    def decref(self, i: int) -> None:
        it = self.items[i]
        if it.ref == 1 and it.pin:
            raise RuntimeError(f"{self.name}: item {i} would be freed while pinned")
        it.ref -= 1
        if it.ref == 0:
            self.free[it.tier].append(it.slot)
            del self.items[i]

    def pin(self, i: int) -> None:
        self.ensure_device(i)
        self.items[i].pin += 1
        self.touch(i)

    def unpin(self, i: int) -> None:
        it = self.items[i]
        if it.pin <= 0:
            raise RuntimeError(f"{self.name}: item {i} unpinned more often than pinned")
        it.pin -= 1

    # ------------------------------------------------------------------ tiers
    def ensure_device(self, i: int) -> None:
        it = self.items[i]
        if it.tier == "device":
            return
        it.pin += 1  # a host item cannot be picked as a spill victim anyway; this guards reclaimers
        try:
            slot = self._device_slot()
        finally:
            it.pin -= 1
        for k in self.dev:
            self.dev[k][slot].copy_(self.host[k][it.slot], non_blocking=False)
        self.free["host"].append(it.slot)
        it.tier, it.slot = "device", slot
        self.stats["restores"] += 1

    def _device_slot(self) -> int:
        while not self.free["device"]:
            victim = self._lru("device")
            if victim is not None and self.free["host"]:
                self._spill(victim)
                continue
            if victim is not None and self.capacity["host"] and self._reclaim("host"):
                continue  # dropped spilled data to make room on the host tier
            if self._reclaim("device"):
                continue
            raise PoolExhausted(f"{self.name}: all {self.capacity['device']} device slots are pinned by running "
                                f"sequences; raise the budget or lower max_running")
        return self.free["device"].pop()

    def _reclaim(self, tier: str) -> bool:
        return self.reclaimer is not None and self.reclaimer(tier)

    def _lru(self, tier: str) -> int | None:
        best, best_t = None, None
        for i, it in self.items.items():
            if it.tier == tier and it.pin == 0 and (best_t is None or it.last_used < best_t):
                best, best_t = i, it.last_used
        return best

    def _spill(self, i: int) -> None:
        it = self.items[i]
        hslot = self.free["host"].pop()
        for k in self.dev:
            self.host[k][hslot].copy_(self.dev[k][it.slot])
        self.free["device"].append(it.slot)
        it.tier, it.slot = "host", hslot
        self.stats["spills"] += 1

    def check(self) -> None:
        """Invariants: every slot is free or held by exactly one item."""
        for tier in ("device", "host"):
            held = [it.slot for it in self.items.values() if it.tier == tier]
            assert len(held) == len(set(held)), f"{self.name}: {tier} slot held twice"
            assert not set(held) & set(self.free[tier]), f"{self.name}: {tier} slot both free and held"
            assert len(held) + len(self.free[tier]) == self.capacity[tier], f"{self.name}: {tier} slots leaked"
        for i, it in self.items.items():
            assert it.ref >= 1 and it.pin >= 0, f"{self.name}: item {i} has ref {it.ref} pin {it.pin}"
