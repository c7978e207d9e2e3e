"""The all-reduce over any process group (gloo on CPU: the tests' path; NCCL's all-gather on CUDA where symmetric
memory is not used): the peers' tensors are exchanged with all-gathers, and the sums follow the same index math as
the symmetric-memory kernels, so both algorithms (and every transport) return naive.py's bits.

* one-shot: all-gather the whole tensors, every rank sums all of them in rank order.
* two-shot: all-gather, rank r sums only its shard (plan.shard_bounds) in rank order, then the reduced shards are
  all-gathered (padded to the shard size) and concatenated."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .naive import ordered_sum
from .plan import Algorithm, AllReduceConfig, shard_bounds, shard_size


# torch >= 2.13 names it all_gather_single (all_gather_into_tensor deprecated); the H200 machine's 2.11 has only
# the old name.
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_rows(flat: torch.Tensor, group) -> torch.Tensor:
    """[W, n]: row r is rank r's 1-D `flat` (one all-gather into a flat buffer: gloo wants the concatenation)."""
    world = dist.get_world_size(group)
    out = torch.empty(world * flat.numel(), dtype=flat.dtype, device=flat.device)
    _gather_single(out, flat, group=group)
    return out.view(world, flat.numel())


def all_reduce_process_group(flat: torch.Tensor, group, algorithm: Algorithm, config: AllReduceConfig
                             ) -> torch.Tensor:
    """Ordered sum of every rank's contiguous 1-D `flat` (equal numel and dtype on every rank, checked before)."""
    gathered = all_gather_rows(flat, group)
    if algorithm is Algorithm.ONE_SHOT:
        return ordered_sum(gathered.unbind(0), flat.dtype)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = flat.numel()
    start, end = shard_bounds(n, world, flat.element_size(), config)[rank]
    size = shard_size(n, world, flat.element_size(), config)
    mine = torch.zeros(size, dtype=flat.dtype, device=flat.device)
    mine[:end - start] = ordered_sum(gathered[:, start:end].unbind(0), flat.dtype)
    shards = all_gather_rows(mine, group)
    return shards.reshape(-1)[:n].clone()
