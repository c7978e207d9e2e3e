"""Exact context parallelism for K3 over contiguous sequence shards (rank r holds tokens [r T, (r + 1) T)).

KDA (`CPKimiDeltaAttention`): the recurrence S_t = A_t S_{t-1} + b_t is affine in the state, so each rank runs its
shard twice through the layer's own recurrence (`KimiDeltaAttention.mix`): from a zero state (local outputs o0 and
final state h) and, with v = 0, from the identity (P_t^T q_t and the shard's state map P = A_T ... A_1). One
all-gather of (P, h) gives every rank its incoming state S_r = P_{r-1} S_{r-1} + h_{r-1} (S_0 = 0), and its
outputs o = o0 + S_r^T P_t^T q_t: equal to the unsharded recurrence up to fp32 rounding, computed in parallel.
The short convolutions take the previous rank's last `conv_kernel_size - 1` projected inputs (one all-gather of
those tokens' hidden states). Gradients flow through the collectives (functional collectives with autograd).

MLA (`CPGatedMLA`): each rank all-gathers the normed 576-value latents (c_kv, k_pe) that the layer computed for its
shard and attends causally over the keys visible to its queries (ranks <= r); queries never leave their rank.

AttnRes, norms and the MoE are per token: they need nothing across ranks (the AttnRes block bank is sharded along
the sequence like the hidden states).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from k3.model.kda import KimiDeltaAttention
from k3.model.mla import GatedMLA

from .comm import gather_along, keep_in_graph


class _KDAShardView:
    """The CacheView a KDA layer sees on a context-parallel rank: no incoming state (the two-pass `mix` supplies
    it), the previous rank's conv windows, nothing stored."""

    def __init__(self, windows: torch.Tensor | None) -> None:
        self.windows = windows

    def kda(self, layer: int):
        return None, self.windows

    def set_kda(self, layer: int, recurrent: torch.Tensor, conv: torch.Tensor) -> None:
        pass

    def mla(self, layer, c_kv, k_pe):
        raise RuntimeError("a KDA shard view holds no MLA cache")


class CPKimiDeltaAttention(KimiDeltaAttention):
    """KimiDeltaAttention on one contiguous shard of a context-parallel group (`cp_group`, set by parallelize)."""

    cp_group = None

    def forward(self, x: torch.Tensor, cache, layer: int) -> torch.Tensor:
        tail = self.conv_size - 1
        rank = dist.get_rank(self.cp_group)
        windows = None
        if tail > 0:  # the pre-conv q/k/v inputs of the previous shard's last tokens, [B, 3, H*K, tail]
            prev = gather_along(x[:, x.shape[1] - tail:], 1, self.cp_group)[max(rank - 1, 0)]
            windows = torch.stack([self.q_proj(prev), self.k_proj(prev), self.v_proj(prev)], dim=1).transpose(2, 3)
            if rank == 0:  # the sequence start: zero history (what no window means), kept in the graph
                windows = windows * 0.0
        return super().forward(x, _KDAShardView(windows), layer)

    def mix(self, q, k, v, g, beta, initial_state):
        if initial_state is not None:
            raise RuntimeError("context-parallel KDA computes its incoming state itself; got an initial_state")
        B, T, H, K = k.shape
        o_local, h_local = super().mix(q, k, v, g, beta, None)
        identity = torch.eye(K, dtype=torch.float32, device=k.device).expand(B, H, K, K).contiguous()
        o_map, state_map = super().mix(q, k, torch.zeros_like(k), g, beta, identity)
        rank = dist.get_rank(self.cp_group)
        # one gather of every shard's (state map P [K, K] | zero-start final state h [K, V])
        shards = gather_along(torch.cat([state_map.float(), h_local.float()], dim=-1), 0, self.cp_group)
        incoming = keep_in_graph(torch.zeros_like(h_local, dtype=torch.float32), shards[0])
        for j in range(rank):
            incoming = shards[j][..., :K] @ incoming + shards[j][..., K:]
        o = o_local + torch.einsum("bthk,bhkv->bthv", o_map.float(), incoming).to(o_local.dtype)
        return o, state_map.float() @ incoming + h_local.float()


class _MLAShardView:
    """The CacheView an MLA layer sees on a context-parallel rank: the latents of every rank up to this one."""

    def __init__(self, group) -> None:
        self.group = group

    def mla(self, layer: int, c_kv: torch.Tensor, k_pe: torch.Tensor):
        rank = dist.get_rank(self.group)
        B, T = c_kv.shape[:2]
        latents = gather_along(torch.cat([c_kv, k_pe], dim=-1), 1, self.group)  # ranks <= r use part of it
        visible = torch.cat(latents[:rank + 1], dim=1)
        keys_c, keys_pe = visible.split([c_kv.shape[-1], k_pe.shape[-1]], dim=-1)
        return keys_c, keys_pe, torch.full((B,), rank * T, dtype=torch.long, device=c_kv.device)

    def kda(self, layer):
        raise RuntimeError("an MLA shard view holds no KDA cache")

    def set_kda(self, layer, recurrent, conv):
        raise RuntimeError("an MLA shard view holds no KDA cache")


class CPGatedMLA(GatedMLA):
    """GatedMLA on one contiguous shard: causal attention over the gathered latents of ranks <= this one."""

    cp_group = None

    def forward(self, x: torch.Tensor, cache, layer: int) -> torch.Tensor:
        return super().forward(x, _MLAShardView(self.cp_group), layer)
