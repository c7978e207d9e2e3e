"""The engine's CacheView: one forward's rows read and write the paged MLA latent KV and the KDA state slots of
the engine's pools (k3.model.state.CacheView protocol)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from k3.rollout.engine import Engine, _Seq


class PoolView:
    """CacheView over the engine's pools for one forward: rows (seq or None = dummy seat) at ragged lengths."""

    def __init__(self, eng: "Engine", rows: list[_Seq | None], T: int):
        self.eng, self.rows, self.T = eng, rows, T
        self.past = torch.tensor([0 if r is None else r.pos for r in rows], dtype=torch.long)
        P = eng.cfg.page_size
        self.S = P * math.ceil((int(self.past.max()) + T) / P)
        self.fresh = all(r is None or r.pos == 0 for r in rows)
        dev = eng.device
        real = [(b, r) for b, r in enumerate(rows) if r is not None]
        pos = [(b, r.pos + t) for b, r in real for t in range(T)]
        self.w_rows = torch.tensor([b for b, _ in pos], dtype=torch.long, device=dev)
        self.w_t = torch.tensor([p - rows[b].pos for b, p in pos], dtype=torch.long, device=dev)
        self.w_slot = torch.tensor([eng.pages.slot(rows[b].bt[p // P]) for b, p in pos], dtype=torch.long, device=dev)
        self.w_off = torch.tensor([p % P for _, p in pos], dtype=torch.long, device=dev)
        self.r_idx = [(b, torch.tensor([eng.pages.slot(pg) for pg in r.bt[:math.ceil((r.pos + T) / P)]],
                                        dtype=torch.long, device=dev), r.pos + T) for b, r in real]
        self.s_rows = [b for b, _ in real]
        self.s_slots = torch.tensor([eng.states.slot(r.state) for _, r in real], dtype=torch.long, device=dev)

    def mla(self, layer, c_kv, k_pe):
        eng = self.eng
        li = eng.mla_index[layer]
        store = eng.pages.dev["kv"]
        new = torch.cat([c_kv, k_pe], dim=-1)
        store[self.w_slot, li, self.w_off] = new[self.w_rows, self.w_t].to(store.dtype)
        B, T, D = new.shape
        keys = new.new_zeros(B, self.S, D)
        for b, slots, n in self.r_idx:
            keys[b, :n] = store[slots, li].reshape(-1, D)[:n]
        for b, r in enumerate(self.rows):
            if r is None:
                keys[b, :T] = new[b]
        return keys[..., :c_kv.shape[-1]], keys[..., c_kv.shape[-1]:], self.past.to(c_kv.device)

    def kda(self, layer):
        if self.fresh:
            return None, None
        ki = self.eng.kda_index[layer]
        rec_store, conv_store = self.eng.states.dev["rec"], self.eng.states.dev["conv"]
        B = len(self.rows)
        rec = rec_store.new_zeros(B, *rec_store.shape[2:])
        conv = conv_store.new_zeros(B, *conv_store.shape[2:])
        rec[self.s_rows] = rec_store[self.s_slots, ki]
        conv[self.s_rows] = conv_store[self.s_slots, ki]
        return rec, conv

    def set_kda(self, layer, recurrent, conv):
        ki = self.eng.kda_index[layer]
        self.eng.states.dev["rec"][self.s_slots, ki] = recurrent[self.s_rows].to(torch.float32)
        self.eng.states.dev["conv"][self.s_slots, ki] = conv[self.s_rows].to(self.eng.states.dev["conv"].dtype)
