"""Deterministic all-reduce: `all_reduce(x, group)` returns the element-wise sum over the group's ranks in rank
order 0..W-1 (fp32 accumulation, one rounding: naive.py), the same bits on every rank, every run, and whichever
algorithm (plan.py: one-shot or two-shot by size and world size) and transport (symm_mem.py on CUDA; the process
group's all-gathers otherwise, gloo on CPU) runs it."""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import checks
from .naive import ordered_sum
from .plan import DEFAULT_CONFIG, Algorithm, AllReduceConfig, choose_algorithm
from .process_group import all_reduce_process_group


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None = None, config: AllReduceConfig = DEFAULT_CONFIG,
               name: str = "x") -> torch.Tensor:
    """A new tensor of x's shape and dtype holding the ordered sum of every rank's `x` (x is not modified).

    Every rank of `group` (default: the world) calls it with the same dtype and shape (contiguous; float32,
    bfloat16 or float16). Bad input raises before any data moves, naming `name`; with
    config.check_across_ranks (default) every rank raises the same error, also for a mismatch across ranks or a
    bad tensor on one rank only, and the group stays usable for the next call."""
    group = group if group is not None else dist.group.WORLD
    world, backend = _group_info(group)
    checks.check_tensor(x, name, backend)
    if config.check_across_ranks:
        checks.check_across_ranks(x, name, group)
    else:
        checks.raise_local(x, name)
    flat = x.detach().view(-1)
    if world == 1 or flat.numel() == 0:
        return ordered_sum([flat], x.dtype).view(x.shape)
    algorithm = choose_algorithm(flat.numel() * flat.element_size(), world, config)
    if flat.is_cuda and config.use_symmetric_memory and "nccl" in backend:
        from .symm_mem import all_reduce_symm_mem  # CUDA only: keeps Triton out of the CPU path

        return all_reduce_symm_mem(flat, group, algorithm, config).view(x.shape)
    return all_reduce_process_group(flat, group, algorithm, config).view(x.shape)


_groups: dict = {}


def _group_info(group) -> tuple[int, str]:
    """(world size, backend name) of a group, looked up once (the per-call host time counts at small sizes)."""
    info = _groups.get(group)
    if info is None:
        info = _groups[group] = (dist.get_world_size(group), str(dist.get_backend(group)))
    return info


__all__ = ["Algorithm", "AllReduceConfig", "all_reduce"]
