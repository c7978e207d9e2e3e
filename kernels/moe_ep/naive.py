"""The spec of the expert-parallel MoE layer: the single-device layer over all experts, run on the tokens of every
rank concatenated in rank order (k3_kernels.moe.naive: router, stable permutation, per-expert SiTU MLPs, combine in
slot order). An EP run over W ranks must return, on rank r, the rows of rank r's tokens of this result, bit for bit
(tests/kernels/test_moe_ep.py), because the dispatch delivers each expert exactly the rows the single-device
permutation gives it, in the same order (source rank, then token, then slot), and the combine sums in slot order.

`naive_local_experts` / `naive_local_experts_fp8` are the expert stage on one rank: expert-sorted received rows ->
expert outputs, the same per-expert operations as naive_experts / naive_experts_fp8 (the FP8 one starts from the
e4m3 rows and scales the dispatch carried, which are the spec's own row quantisation: 1 x 128 blocks of one row)."""
from __future__ import annotations

import torch

from k3_kernels.moe.naive import (naive_dequant_rows, naive_dequant_weight, naive_experts, naive_experts_fp8,
                                  naive_quant_rows, naive_quant_weight, naive_router)
from k3_kernels.situ.naive import naive_situ_and_mul


def naive_ep_layer(xs: list[torch.Tensor], router_weight: torch.Tensor, router_bias: torch.Tensor | None,
                   w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, top_k: int, beta: float = 4.0,
                   linear_beta: float = 25.0, forced: list[torch.Tensor | None] | None = None, fp8: bool = False
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """xs[r] [N_r, L]: rank r's tokens; w1/w3 [E, I, L], w2 [E, L, I]: all experts -> [(y_r [N_r, L], ids_r)]."""
    x = torch.cat(xs)
    f = None
    if forced is not None and any(t is not None for t in forced):
        f = torch.cat([t if t is not None else torch.full((xr.shape[0], top_k), -1, dtype=torch.long)
                       for t, xr in zip(forced, xs)])
    ids, w = naive_router(x, router_weight, router_bias, top_k, forced=f)
    y = (naive_experts_fp8 if fp8 else naive_experts)(x, ids, w, w1, w3, w2, beta, linear_beta)
    out, start = [], 0
    for xr in xs:
        out.append((y[start:start + xr.shape[0]], ids[start:start + xr.shape[0]]))
        start += xr.shape[0]
    return out


def naive_local_experts(rows: torch.Tensor, local_ids: torch.Tensor, w1, w3, w2, beta: float, linear_beta: float
                        ) -> torch.Tensor:
    """rows [R, L] sorted by local expert id (local_ids [R]) -> expert outputs [R, L] (differentiable): the spec's
    per-expert math with one slot of weight 1 (a k = 1 combine is exact)."""
    ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
    return naive_experts(rows, local_ids[:, None], ones, w1, w3, w2, beta, linear_beta)


def naive_local_experts_fp8(q: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor, w1, w3, w2, beta: float,
                            linear_beta: float, out_dtype: torch.dtype) -> torch.Tensor:
    """e4m3 rows q [R, L] with scales [R, L / 128], expert e's rows offsets[e]:offsets[e + 1] -> [R, L]: the
    operations of naive_experts_fp8 after its row quantisation."""
    xp = naive_dequant_rows(q, scale)
    d1, d3, d2 = (naive_dequant_weight(*naive_quant_weight(t)) for t in (w1, w3, w2))
    out = torch.empty(q.shape[0], w2.shape[1], dtype=out_dtype, device=q.device)
    for e in range(w1.shape[0]):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        g, u = (xp[lo:hi] @ d1[e].t()).to(out_dtype), (xp[lo:hi] @ d3[e].t()).to(out_dtype)
        hq, hs = naive_quant_rows(naive_situ_and_mul(g.float(), u.float(), beta, linear_beta))
        out[lo:hi] = (naive_dequant_rows(hq, hs) @ d2[e].t()).to(out_dtype)
    return out
