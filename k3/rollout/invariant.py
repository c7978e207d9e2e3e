"""Row-invariant matmuls on CPU BLAS: a dispatch mode that pads the row count M of small mm/addmm/bmm calls up
to `min_rows` with zero rows. MKL's sgemm takes different code paths for small M (and for M not a multiple of its
row block), so a row's product can change with how many other rows share the call: in the MoE, with how many
tokens of the batch picked the same expert. Past the threshold every row goes through the same kernel and its
result depends on that row alone (checked bitwise in tests/rollout/test_invariance.py)."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class RowInvariantMatmul(TorchDispatchMode):
    def __init__(self, min_rows: int = 16):
        super().__init__()
        self.min_rows = min_rows

    def _pad(self, a: torch.Tensor, dim: int) -> torch.Tensor:
        shape = list(a.shape)
        shape[dim] = self.min_rows - a.shape[dim]
        return torch.cat([a, a.new_zeros(shape)], dim=dim)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.mm.default and args[0].shape[0] < self.min_rows:
            a, b = args
            return func(self._pad(a, 0), b)[:a.shape[0]]
        if func is aten.addmm.default and args[1].shape[0] < self.min_rows and args[0].dim() <= 1:
            bias, a, b = args
            return func(bias, self._pad(a, 0), b, **kwargs)[:a.shape[0]]
        if func is aten.bmm.default and args[0].shape[1] < self.min_rows:
            a, b = args
            return func(self._pad(a, 1), b)[:, :a.shape[1]]
        return func(*args, **kwargs)
