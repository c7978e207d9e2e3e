"""Expert parallelism for K3's latent MoE: rank r of the expert group (`ep_group`, size n) holds experts
[r E/n, (r + 1) E/n) (a DTensor sharded on the "ep" mesh; FSDP shards it further over "efsdp").

Dispatch and combine (`EPRoutedExperts.forward`): the group's latent tokens, expert ids and gate weights are
all-gathered; each rank runs its experts on the (token, slot) pairs routed to them through k3.model's own
`RoutedExperts.forward` (the same SiTU expert math and `project` hook, on the local weight shard), writes each pair
once, sums over its slots, and a reduce-scatter returns to every rank the sum over ranks for its own tokens.
Gradients flow back through the same collectives (functional collectives with autograd), so each expert's gradient
covers every token of the group routed to it. Routing (and Router Replay) is unchanged: the router runs before.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from k3.model.moe import RoutedExperts

from .comm import gather_along, keep_in_graph, reduce_scatter_rows


class _LocalShard:
    """What RoutedExperts.forward reads from `self`, with this rank's expert weights (local tensors)."""

    def __init__(self, owner: RoutedExperts, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> None:
        self.w1, self.w2, self.w3 = w1, w2, w3
        self.beta, self.linear_beta = owner.beta, owner.linear_beta
        self.project = owner.project


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


class EPRoutedExperts(RoutedExperts):
    ep_group = None

    def forward(self, z: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, ids_checked: bool = False) -> torch.Tensor:
        group = self.ep_group
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        N, k = idx.shape
        z_all = torch.cat(gather_along(z, 0, group))
        w_all = torch.cat(gather_along(w, 0, group))
        with torch.no_grad():
            idx_all = torch.cat(gather_along(idx, 0, group))
        if z_all.shape[0] != n * N:
            raise RuntimeError(f"expert parallelism needs the same token count on every rank of the expert group; "
                               f"rank {rank} has {N}, the group {z_all.shape[0]}")
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        per_rank = w1.shape[0]
        first = rank * per_rank
        mine = (idx_all >= first) & (idx_all < first + per_rank)
        tok, slot = mine.nonzero(as_tuple=True)
        pairs = z_all.new_zeros(n * N, k, z.shape[-1])
        if tok.numel():
            y = RoutedExperts.forward(_LocalShard(self, w1, w2, w3), z_all[tok], (idx_all[tok, slot] - first)[:, None],
                                      w_all[tok, slot][:, None])
            pairs = pairs.index_put((tok, slot), y)
        pairs = keep_in_graph(pairs, z_all, w_all, w1, w2, w3)  # a rank none of whose experts were chosen
        return reduce_scatter_rows(pairs.float().sum(1), group).to(z.dtype)
