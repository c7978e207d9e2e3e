"""Exact context parallelism for K3 over contiguous sequence shards (rank r holds tokens [r T, (r + 1) T)).

KDA (`CPKimiDeltaAttention`): the recurrence S_t = A_t S_{t-1} + b_t is affine in the state, so each rank runs its
shard twice through the layer's own recurrence (`KimiDeltaAttention.mix`): from a zero state (local outputs o0 and
final state h) and, with v = 0, from the identity (P_t^T q_t and the shard's state map P = A_T ... A_1). One
all-gather of (P, h) gives every rank its incoming state S_r = P_{r-1} S_{r-1} + h_{r-1} (S_0 = 0), and its
outputs o = o0 + S_r^T P_t^T q_t: equal to the unsharded recurrence up to fp32 rounding, computed in parallel.
The short convolutions take the previous rank's last `conv_kernel_size - 1` projected inputs (one all-gather of
those tokens' hidden states). Gradients flow through the collectives (functional collectives with autograd).

MLA (`CPGatedMLA`, load-balanced causal attention on the contiguous shards KDA needs): the sequence is cut into
2 n chunks of C = T / 2 tokens (rank r holds chunks 2r and 2r + 1); rank r computes the queries of chunks r and
2n - 1 - r, whose causal work adds up to the same (2n + 1) C^2 score elements on every rank. Each rank all-gathers
the normed 576-value latents (c_kv, k_pe) of every shard, one all-to-all moves each query chunk to the rank that
computes it and a second one brings its attention output back; chunk c attends to the gathered latents sliced to
its own end (c + 1) C (chunk-level block skipping: keys past the chunk are never scored). The gate and o_proj run
on the holder. `ContiguousCPGatedMLA` (each rank attends its own queries over the keys of ranks <= r: rank r
scores (r + 1) T^2, the last rank n times the first's) is kept as the simple form the balanced one is measured
against (`mla_score_elements`).

AttnRes, norms and the MoE are per token: they need nothing across ranks (the AttnRes block bank is sharded along
the sequence like the hidden states).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

from k3.model.kda import KimiDeltaAttention
from k3.model import ops
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


class ContiguousCPGatedMLA(GatedMLA):
    """GatedMLA on one contiguous shard, unbalanced: causal attention over the gathered latents of ranks <= this
    one (the last rank does n times the first's work)."""

    cp_group = None

    def forward(self, x: torch.Tensor, cache, layer: int) -> torch.Tensor:
        return super().forward(x, _MLAShardView(self.cp_group), layer)


def balanced_query_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two of 2 cp sequence chunks whose queries `rank` computes: r and 2 cp - 1 - r (equal causal work)."""
    return rank, 2 * cp - 1 - rank


def mla_score_elements(seq_len: int, cp: int, *, balanced: bool) -> list[int]:
    """Query-key score elements per rank (per batch row and head) of one MLA layer under CP: what each rank's
    attention computes (keys up to each query block's end; the causal mask inside the block is not skipped)."""
    if cp == 1:
        return [seq_len * seq_len]
    if not balanced:
        t = seq_len // cp
        return [t * (r + 1) * t for r in range(cp)]
    c = seq_len // (2 * cp)
    return [sum(c * (j + 1) * c for j in balanced_query_chunks(cp, r)) for r in range(cp)]


@dataclass(frozen=True)
class _ChunkExchange:
    """The all-to-all plan moving query chunks from their holders (rank h holds chunks 2h, 2h + 1) to the ranks that
    compute them, for one rank: chunks sent (ascending destination, then chunk) and received (ascending source)."""
    sent: tuple[int, ...]
    sent_splits: tuple[int, ...]
    received: tuple[int, ...]
    received_splits: tuple[int, ...]

    @staticmethod
    def plan(cp: int, rank: int) -> "_ChunkExchange":
        def computer(c: int) -> int:
            return c if c < cp else 2 * cp - 1 - c

        held = (2 * rank, 2 * rank + 1)
        sent = tuple(c for d in range(cp) for c in held if computer(c) == d)
        sent_splits = tuple(sum(computer(c) == d for c in held) for d in range(cp))
        received = tuple(c for h in range(cp) for c in (2 * h, 2 * h + 1) if computer(c) == rank)
        received_splits = tuple(sum(computer(c) == rank for c in (2 * h, 2 * h + 1)) for h in range(cp))
        return _ChunkExchange(sent, sent_splits, received, received_splits)


def _all_to_all(x: torch.Tensor, out_splits: tuple[int, ...], in_splits: tuple[int, ...], group) -> torch.Tensor:
    return fc.wait_tensor(fc.all_to_all_single_autograd(x.contiguous(), list(out_splits), list(in_splits), group))


class CPGatedMLA(GatedMLA):
    """GatedMLA on one contiguous shard with load-balanced causal attention (module docstring); the parameters,
    projections and math are GatedMLA's (`ops.mla_attention` per query chunk)."""

    cp_group = None

    def forward(self, x: torch.Tensor, cache, layer: int) -> torch.Tensor:
        group = self.cp_group
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        B, T, _ = x.shape
        if T % 2:
            raise ValueError(f"x: a load-balanced MLA shard needs an even length (two chunks), got {T} tokens")
        H, C = self.n_heads, T // 2
        q = self._query(x).view(B, 2, C, H, self.nope + self.rope)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        latents = torch.cat(gather_along(torch.cat([c_kv, k_pe], dim=-1), 1, group), dim=1)  # [B, n T, 576]
        plan = _ChunkExchange.plan(n, rank)
        send = torch.stack([q[:, c - 2 * rank] for c in plan.sent])               # [2, B, C, H, qk]
        mine = _all_to_all(send, plan.received_splits, plan.sent_splits, group)   # chunks plan.received
        end = (max(plan.received) + 1) * C
        k_nope, v = self.kv_b_proj(latents[:, :end, :self.kv_lora]).view(B, end, H, self.nope + self.v_dim).split(
            [self.nope, self.v_dim], -1)
        k_rope = latents[:, :end, self.kv_lora:]
        outs = []
        for q_chunk, c in zip(mine, plan.received):
            stop = (c + 1) * C  # chunk-level block skipping: no key after the chunk's last query is scored
            q_nope, q_pe = q_chunk.split([self.nope, self.rope], dim=-1)
            past = torch.full((B,), c * C, dtype=torch.long, device=x.device)
            outs.append(ops.mla_attention(q_nope, q_pe, k_nope[:, :stop], k_rope[:, :stop], v[:, :stop], past,
                                          self.scale).to(x.dtype))
        back = _all_to_all(torch.stack(outs), plan.sent_splits, plan.received_splits, group)  # chunks plan.sent
        by_chunk = dict(zip(plan.sent, back))
        attn = torch.cat([by_chunk[2 * rank], by_chunk[2 * rank + 1]], dim=1)
        attn = keep_in_graph(attn.reshape(B, T, H * self.v_dim), latents)
        if self.g_proj is not None:
            attn = attn * torch.sigmoid(self.g_proj(x))
        return self.o_proj(attn)
