"""KDA verify over a token tree in Triton: every node's output from its parent's state, storing no state per node.

One program per (row, value head, V block) loads its [K, BV] slice of the committed fp32 state and, for each node n,
walks n's path from the committed state (root first: its ancestors' stored step inputs, then n's own) with the
decode kernel's state update, op for op and with its block shape (k3_kernels.kda.fused_recurrent:
S <- S * e^g; u = v - S^T k; S += beta k u^T; o = S^T (scale q); BK = next_pow2(K), BV = min(32, next_pow2(V)),
4 warps), and writes n's output: what decode outputs at n if n's path is the sequence. The per-node states live
in registers only (recomputed along each path: N x depth steps, <= 16 x 15), never in memory. With `accept_node`
it also writes the state after each row's accepted node (the ReplaySSM commit of the accepted path).
The reference (the spec) is `naive.naive_tree_verify`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3_kernels.launch import cdiv, next_pow2

from .naive import check_tree_inputs, tree_paths


@triton.jit
def _step(S, k, v, g, beta, row, h, hv, H, HV, K, V, ok, km, ov, vm):
    kt = tl.load(k + (row * H + h) * K + ok, mask=km, other=0.).to(tl.float32)
    vt = tl.load(v + (row * HV + hv) * V + ov, mask=vm, other=0.).to(tl.float32)
    gt = tl.load(g + (row * HV + hv) * K + ok, mask=km, other=0.).to(tl.float32)
    bt = tl.load(beta + row * HV + hv).to(tl.float32)
    S = S * tl.exp(gt)[:, None]
    u = vt - tl.sum(kt[:, None] * S, 0)
    S += (bt * kt)[:, None] * u[None, :]
    return S


@triton.jit
def _tree_verify(state, q, k, v, g, beta, paths, depths, accept, o, out, scale, B, N, D, H, HV, K, V,
                 BK: tl.constexpr, BV: tl.constexpr, HAS_ACCEPT: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1).to(tl.int64)
    iv = tl.program_id(2)
    h = hv // (HV // H)
    ok = tl.arange(0, BK)
    km = ok < K
    ov = iv * BV + tl.arange(0, BV)
    vm = ov < V
    mkv = km[:, None] & vm[None, :]
    ps = (b * HV + hv) * K * V + ok[:, None] * V + ov[None, :]
    S0 = tl.zeros([BK, BV], dtype=tl.float32)
    S0 += tl.load(state + ps, mask=mkv, other=0.)
    for n in range(0, N):
        S = S0
        dn = tl.load(depths + b * N + n).to(tl.int64)
        for j in range(0, dn):
            m = tl.load(paths + (b * N + n) * D + j).to(tl.int64)
            S = _step(S, k, v, g, beta, m * B + b, h, hv, H, HV, K, V, ok, km, ov, vm)
        row = n * B + b
        qt = tl.load(q + (row * H + h) * K + ok, mask=km, other=0.).to(tl.float32)
        ot = tl.sum((qt * scale)[:, None] * S, 0)
        tl.store(o + (row * HV + hv) * V + ov, ot.to(o.dtype.element_ty), mask=vm)
    if HAS_ACCEPT:
        a = tl.load(accept + b).to(tl.int64)
        S = S0
        if a >= 0:
            da = tl.load(depths + b * N + a).to(tl.int64)
            for j in range(0, da):
                m = tl.load(paths + (b * N + a) * D + j).to(tl.int64)
                S = _step(S, k, v, g, beta, m * B + b, h, hv, H, HV, K, V, ok, km, ov, vm)
        tl.store(out + ps, S, mask=mkv)


def tree_verify(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, parents: torch.Tensor, accept_node: torch.Tensor | None = None,
                scale: float | None = None, paths: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as `naive_tree_verify`: state [B, HV, K, V] fp32 (not modified); q, k [N, B, H, K] (q, k
    L2-normed); v [N, B, HV, V]; g [N, B, HV, K] (log-decay); beta [N, B, HV]; parents [B, N] int (-1: the
    committed state; parent < node); accept_node [B] (-1: none) -> (o [N, B, HV, V] in v's dtype, the state after
    each row's accepted node or None). `scale` defaults to K ** -0.5, as the decode kernel's. `paths`: the
    tree's `tree_paths(parents, width)` on state's device, computed ahead (a CUDA graph captures the verify with no
    host work inside it; the caller derives them from the same parents); None: computed here, on the host."""
    check_tree_inputs(state, q, k, v, g, beta, parents, accept_node)
    B, HV, K, V = state.shape
    N, H = k.shape[0], k.shape[2]
    if not (1 <= K <= 256 and 1 <= V <= 256):
        raise ValueError(f"state: head dims must be in [1, 256], got K={K}, V={V}")
    dev = state.device
    if paths is None:
        paths = tree_paths(parents)
    elif (paths[0].dim() != 3 or tuple(paths[0].shape[:2]) != (B, N) or tuple(paths[1].shape) != (B, N)
          or paths[0].device != dev or paths[1].device != dev):
        raise ValueError(f"paths: expected ([B={B}, N={N}, D], [B={B}, N={N}]) on {dev}, got "
                         f"{[(tuple(x.shape), str(x.device)) for x in paths]}")
    paths, depths = (x.to(dev).contiguous() for x in paths)
    D = paths.shape[2]
    state, q, k, v, g, beta = (x.contiguous() for x in (state, q, k, v, g, beta))
    o = torch.empty_like(v)
    out = torch.empty_like(state) if accept_node is not None else None
    acc = (accept_node.to(device=dev, dtype=torch.int32).contiguous() if accept_node is not None
           else depths)
    if B == 0 or (N == 0 and out is None):
        return o, out
    scale = K ** -0.5 if scale is None else float(scale)
    BK, BV = next_pow2(K), min(32, next_pow2(V))
    _tree_verify[(B, HV, cdiv(V, BV))](state, q, k, v, g, beta, paths, depths, acc, o,
                                       out if out is not None else o, scale, B, N, D, H, HV, K, V,
                                       BK=BK, BV=BV, HAS_ACCEPT=accept_node is not None, num_warps=4)
    return o, out
