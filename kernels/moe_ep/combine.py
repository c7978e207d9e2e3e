"""Combine: expert outputs back to their source ranks (the reverse all_to_all of the dispatch) and the top-k
weighted sum in slot order in fp32, rounded once (no atomics, no scatter-add): the spec's naive_combine, or the
moe kernels' `combine`. Its backward (`combine_grads`) gives the returned rows' gradients (sent to the
experts by the dispatch's exchange) and the gate weights' gradients (exactly as autograd differentiates naive_combine,
or the moe kernels' combine_backward), and `sum_row_grads` the tokens' gradients from their
pairs' rows, in the single-device layer's order."""
from __future__ import annotations

import torch

from k3_kernels.moe.naive import naive_combine

from .dispatch import Route, exchange


def return_rows(y_source_major: torch.Tensor, route: Route, group) -> torch.Tensor:
    """Expert outputs (source-major, as received) -> this rank's pairs' outputs in sorted-row order [P, L]."""
    out = y_source_major.new_empty(route.sent, y_source_major.shape[1])
    exchange(out, y_source_major, route.send_splits, route.recv_splits, group)
    return out


def weighted_sum(y: torch.Tensor, route: Route, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    if route.kernels:
        from k3_kernels.moe.permute import RoutingPlan, combine

        plan = RoutingPlan(route.order, route.pos, torch.empty(0), torch.empty(0), 0, route.pos.shape[1])
        return combine(y, plan, w, out_dtype)
    return naive_combine(y, route.pos, w, out_dtype)


def combine_grads(dout: torch.Tensor, y: torch.Tensor, route: Route, w: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dy [P, L] in y's dtype: dy[pos[t, j]] = w[t, j] dout[t]; dw [n, k] fp32: <dout[t], y[pos[t, j]]>)."""
    if route.kernels:
        from k3_kernels.moe.permute import RoutingPlan, combine_backward

        plan = RoutingPlan(route.order, route.pos, torch.empty(0), torch.empty(0), 0, route.pos.shape[1])
        return combine_backward(dout, y, plan, w)
    g = dout.float()
    dy = torch.empty_like(y)
    dw = torch.empty(route.pos.shape, dtype=torch.float32, device=y.device)
    for j in range(route.pos.shape[1]):
        p = route.pos[:, j]
        dy[p] = (g * w[:, j:j + 1].float()).to(y.dtype)
        dw[:, j:j + 1] = (g * y[p].float()).sum(1, keepdim=True)
    return dy, dw


def sum_row_grads(dxp: torch.Tensor, route: Route, out_dtype: torch.dtype) -> torch.Tensor:
    """dz[t] = the sum of t's pairs' row gradients, in the order of the single-device layer on this device: with the
    kernels the moe layer's (combine in slot order, fp32, rounded once), else autograd's through the spec (the index
    backward of the permutation: ascending sorted row, accumulated in out_dtype: 0 + a + b + ...)."""
    if route.kernels:
        from k3_kernels.moe.permute import RoutingPlan, combine

        plan = RoutingPlan(route.order, route.pos, torch.empty(0), torch.empty(0), 0, route.pos.shape[1])
        return combine(dxp, plan, None, out_dtype)
    pos = route.pos.sort(1).values
    acc = torch.zeros(pos.shape[0], dxp.shape[1], dtype=out_dtype, device=dxp.device)
    for j in range(pos.shape[1]):
        acc = acc + dxp[pos[:, j]].to(out_dtype)
    return acc
