"""Decode state of the reference model: what `extend` needs to continue a batch of sequences exactly.

MLA layers keep their latent KV (the normed 512-d c_KV and the 64-d k_pe: 576 values/token in K3); KDA layers keep
the fp32 recurrent state and the short-conv windows (last `conv_kernel_size - 1` pre-conv q/k/v inputs).
Attention Residuals mix across depth only, per token, so they need no state across tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class MLACache:
    c_kv: torch.Tensor  # [B, S, kv_lora_rank], after kv_a_layernorm
    k_pe: torch.Tensor  # [B, S, qk_rope_head_dim]

    def clone(self) -> "MLACache":
        return MLACache(self.c_kv.clone(), self.k_pe.clone())


@dataclass
class KDACache:
    recurrent: torch.Tensor  # [B, H, K, V] fp32
    conv: torch.Tensor       # [B, 3, H*K, W-1]: q, k, v pre-conv windows

    def clone(self) -> "KDACache":
        return KDACache(self.recurrent.clone(), self.conv.clone())


@dataclass
class K3State:
    """Per-layer caches for a batch whose sequences all have `seq_len` tokens so far."""
    layers: list[MLACache | KDACache | None] = field(default_factory=list)
    seq_len: int = 0

    def clone(self) -> "K3State":
        """An independent copy: extending the clone never changes this state (branching)."""
        return K3State([None if c is None else c.clone() for c in self.layers], self.seq_len)

    @property
    def batch_size(self) -> int:
        for c in self.layers:
            if isinstance(c, MLACache):
                return c.c_kv.shape[0]
            if isinstance(c, KDACache):
                return c.recurrent.shape[0]
        return 0

    def select(self, index: torch.Tensor | list[int]) -> "K3State":
        """The sub-batch of rows `index` (a copy)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        out: list[MLACache | KDACache | None] = []
        for c in self.layers:
            if isinstance(c, MLACache):
                out.append(MLACache(c.c_kv[idx.to(c.c_kv.device)], c.k_pe[idx.to(c.k_pe.device)]))
            elif isinstance(c, KDACache):
                out.append(KDACache(c.recurrent[idx.to(c.recurrent.device)], c.conv[idx.to(c.conv.device)]))
            else:
                out.append(None)
        return K3State(out, self.seq_len)

    @staticmethod
    def concat(states: list["K3State"]) -> "K3State":
        """Stack states of equal `seq_len` along the batch dim."""
        if not states:
            raise ValueError("states: need at least one state to concat")
        lens = {s.seq_len for s in states}
        if len(lens) != 1:
            raise ValueError(f"states: seq_len differs across states ({sorted(lens)}); cannot batch them")
        out: list[MLACache | KDACache | None] = []
        for per_layer in zip(*(s.layers for s in states)):
            c0 = per_layer[0]
            if isinstance(c0, MLACache):
                out.append(MLACache(torch.cat([c.c_kv for c in per_layer]), torch.cat([c.k_pe for c in per_layer])))
            elif isinstance(c0, KDACache):
                out.append(KDACache(torch.cat([c.recurrent for c in per_layer]), torch.cat([c.conv for c in per_layer])))
            else:
                out.append(None)
        return K3State(out, states[0].seq_len)

    def nbytes(self) -> int:
        total = 0
        for c in self.layers:
            if isinstance(c, MLACache):
                total += c.c_kv.nbytes + c.k_pe.nbytes
            elif isinstance(c, KDACache):
                total += c.recurrent.nbytes + c.conv.nbytes
        return total


class CacheView(Protocol):
    """What the layers read and write during one forward. `DenseCache` implements it over a `K3State` (all rows
    at the same length); a rollout engine implements it over its page and state-slot pools (ragged lengths)."""

    def mla(self, layer: int, c_kv: torch.Tensor, k_pe: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store this step's latent KV [B, T, *]; return every key of each row [B, S, *] (row b's past keys at
        [0, past_b), then its T new keys) and the past lengths `past_b` [B] (int64)."""
        ...

    def kda(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(recurrent state [B, H, K, V] fp32, conv windows [B, 3, H*K, W-1]) or (None, None) for fresh rows."""
        ...

    def set_kda(self, layer: int, recurrent: torch.Tensor, conv: torch.Tensor) -> None:
        ...


class DenseCache:
    """CacheView over an immutable K3State: reads `state`, writes a new state (`result`); `store=False` keeps
    nothing (training forward)."""

    def __init__(self, state: K3State | None, n_layers: int, batch: int, device: torch.device, store: bool = True):
        self.past = state.layers if state is not None and state.layers else [None] * n_layers
        self.past_len = state.seq_len if state is not None else 0
        self.new: list[MLACache | KDACache | None] = [None] * n_layers
        self.batch, self.device, self.store = batch, device, store

    def mla(self, layer, c_kv, k_pe):
        past = self.past[layer]
        if past is not None:
            c_kv = torch.cat([past.c_kv, c_kv], dim=1)
            k_pe = torch.cat([past.k_pe, k_pe], dim=1)
        if self.store:
            self.new[layer] = MLACache(c_kv, k_pe)
        return c_kv, k_pe, torch.full((self.batch,), self.past_len, dtype=torch.long, device=self.device)

    def kda(self, layer):
        past = self.past[layer]
        return (None, None) if past is None else (past.recurrent, past.conv)

    def set_kda(self, layer, recurrent, conv):
        if self.store:
            self.new[layer] = KDACache(recurrent, conv)

    def result(self, new_tokens: int) -> K3State:
        return K3State(self.new, self.past_len + new_tokens)
