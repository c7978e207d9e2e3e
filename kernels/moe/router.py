"""Fused noaux_tc router (Triton): logits GEMM, sigmoid, correction bias, top-k, renormalisation in one kernel.

Each program owns BLOCK_M tokens and all experts (padded to a power of two: 1024 for K3's 896), accumulates the
logits over the hidden size in a fixed order (one configuration, never chosen by the token count: a token's ids
and weights do not depend on its batch), and picks the top k by k rounds of argmax with ties to the lowest id
(the spec's stable sort). Router Replay: `forced` ids replace the choice (rows whose first id is -1 route
freely) and the weights are recomputed from the current scores. The backward (gate weights -> router weight and
input) runs in torch: a dense [N, E] logit gradient, zero off the chosen experts, and two GEMMs.
Spec: naive.naive_router.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3_kernels.launch import cdiv, next_pow2
from k3_kernels.moe.grouped_gemm import _prec


@triton.jit
def _router_kernel(x_ptr, w_ptr, b_ptr, f_ptr, ids_ptr, wt_ptr, s_ptr, N, D, E, x_stride, scaling,
                   TOP_K: tl.constexpr, K_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_FORCED: tl.constexpr,
                   RENORM: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < N
    r64 = rows.to(tl.int64)
    ex = tl.arange(0, BLOCK_E)
    emask = ex < E
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_E), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        km = (k0 + kk) < D
        a = tl.load(x_ptr + r64[:, None] * x_stride + k0 + kk[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
        b = tl.load(w_ptr + ex[None, :].to(tl.int64) * D + k0 + kk[:, None], mask=km[:, None] & emask[None, :],
                    other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PREC)
    s = tl.sigmoid(acc)
    sel = s
    if HAS_BIAS:
        sel = sel + tl.load(b_ptr + ex, mask=emask, other=0.0).to(tl.float32)[None, :]
    sel = tl.where(emask[None, :], sel, float("-inf"))
    kc = tl.arange(0, K_PAD)
    chosen = tl.zeros((BLOCK_M, K_PAD), dtype=tl.int32)
    weights = tl.zeros((BLOCK_M, K_PAD), dtype=tl.float32)
    if HAS_FORCED:
        free = tl.load(f_ptr + r64 * TOP_K, mask=rmask, other=-1) < 0
    for j in tl.static_range(TOP_K):
        best = tl.argmax(sel, axis=1, tie_break_left=True).to(tl.int32)
        sel = tl.where(ex[None, :] == best[:, None], float("-inf"), sel)
        if HAS_FORCED:
            best = tl.where(free, best, tl.load(f_ptr + r64 * TOP_K + j, mask=rmask, other=0).to(tl.int32))
        sj = tl.sum(tl.where(ex[None, :] == best[:, None], s, 0.0), axis=1)
        chosen = tl.where(kc[None, :] == j, best[:, None], chosen)
        weights = tl.where(kc[None, :] == j, sj[:, None], weights)
    km2 = rmask[:, None] & (kc < TOP_K)[None, :]
    out = r64[:, None] * TOP_K + kc[None, :]
    tl.store(s_ptr + out, weights, mask=km2)
    if RENORM:
        weights = weights / (tl.sum(weights, axis=1)[:, None] + 1e-20)
    tl.store(ids_ptr + out, chosen.to(ids_ptr.dtype.element_ty), mask=km2)
    tl.store(wt_ptr + out, weights * scaling, mask=km2)


def _route(x, weight, bias, top_k, renormalize, scaling, forced):
    N, D = x.shape
    E = weight.shape[0]
    ids = torch.empty(N, top_k, device=x.device, dtype=torch.int64)
    wts = torch.empty(N, top_k, device=x.device, dtype=torch.float32)
    s = torch.empty(N, top_k, device=x.device, dtype=torch.float32)
    if N:
        BE = max(16, next_pow2(E))
        BM = 16
        BK = 32 if x.is_cuda and BE > 512 else 64 if x.is_cuda else 32
        f = forced.contiguous() if forced is not None else ids
        _router_kernel[(cdiv(N, BM),)](
            x, weight, bias if bias is not None else wts, f, ids, wts, s, N, D, E, x.stride(0), float(scaling),
            TOP_K=top_k, K_PAD=next_pow2(top_k), HAS_BIAS=bias is not None, HAS_FORCED=forced is not None,
            RENORM=renormalize, PREC=_prec(x.dtype), BLOCK_M=BM, BLOCK_E=BE, BLOCK_K=BK,
            num_warps=8 if BE > 256 else 4, num_stages=2)
    return ids, wts, s


class _RouterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, top_k, renormalize, scaling, forced):
        ids, wts, s = _route(x, weight, bias, top_k, renormalize, scaling, forced)
        ctx.save_for_backward(x, weight, ids, s)
        ctx.meta = (renormalize, scaling)
        ctx.mark_non_differentiable(ids)
        return ids, wts

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, _dids, dw):
        x, weight, ids, s = ctx.saved_tensors
        renormalize, scaling = ctx.meta
        dw = dw.float() * scaling
        if renormalize:
            total = s.sum(-1, keepdim=True) + 1e-20
            ds = dw / total - (dw * s).sum(-1, keepdim=True) / total ** 2
        else:
            ds = dw
        dlogit = torch.zeros(x.shape[0], weight.shape[0], device=x.device, dtype=torch.float32)
        dlogit.scatter_(1, ids, ds * s * (1 - s))  # ids of a row are distinct: a plain scatter, no accumulation
        # operands in the forward's dtype (bf16 GEMMs for a bf16 router, fp32 for an fp32 one), fp32 accumulation
        g = dlogit.to(x.dtype)
        dx = (g @ weight).to(x.dtype) if ctx.needs_input_grad[0] else None
        dweight = (g.t() @ x).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx, dweight, None, None, None, None, None


def fused_router(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                 renormalize: bool = True, scaling: float = 1.0, forced: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, d], weight [E, d], bias [E] | None, forced [N, k] | None -> (ids [N, k] int64, weights [N, k] fp32);
    the contract of naive.naive_router (weights differentiable w.r.t. x and weight)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x: expected [N, d] with contiguous rows, got shape {tuple(x.shape)}")
    E, d = weight.shape
    if x.shape[1] != d or weight.dtype != x.dtype:
        raise ValueError(f"weight: expected [E, {x.shape[1]}] {x.dtype}, got {tuple(weight.shape)} {weight.dtype}")
    if not 0 < top_k <= E:
        raise ValueError(f"top_k: must be in [1, {E}], got {top_k}")
    if bias is not None and bias.shape != (E,):
        raise ValueError(f"bias: expected [{E}], got {tuple(bias.shape)}")
    if forced is not None and forced.shape != (x.shape[0], top_k):
        raise ValueError(f"forced: expected [{x.shape[0]}, {top_k}], got {tuple(forced.shape)}")
    return _RouterFn.apply(x, weight.contiguous(), bias.float().contiguous() if bias is not None else None, top_k,
                           renormalize, scaling, forced)
