"""Differentiable collectives for the parallel layers (torch's functional collectives with autograd: an all-gather's
backward reduce-scatters, and back).

Every rank of a group must run the same collectives in the same order, backward included: a gathered tensor that
one rank does not use would leave its backward reduce-scatter unexecuted there and deadlock the group. Callers
therefore keep every gathered tensor in the graph (`keep_in_graph`)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc


def gather_along(x: torch.Tensor, dim: int, group) -> list[torch.Tensor]:
    """All ranks' `x` (equal shapes) in rank order, split back into one tensor per rank along `dim`."""
    n = dist.get_world_size(group)
    full = fc.wait_tensor(fc.all_gather_single_autograd(x.movedim(dim, 0).contiguous(), 0, group))
    return [part.movedim(0, dim) for part in full.chunk(n, dim=0)]


def reduce_scatter_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Sum `x` [n * N, ...] over the group's ranks; rank r receives rows [r N, (r + 1) N)."""
    return fc.wait_tensor(fc.reduce_scatter_single_autograd(x.contiguous(), "sum", 0, group))


def keep_in_graph(y: torch.Tensor, *used: torch.Tensor) -> torch.Tensor:
    """`y` unchanged in value, depending on `used` (zero gradient), so their collectives' backward runs here too."""
    return y + sum(0.0 * u.sum() for u in used).to(y.dtype)
