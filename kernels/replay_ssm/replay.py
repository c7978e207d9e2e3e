"""ReplaySSM commit for KDA in Triton: fold each row's accepted step inputs into its committed state in one launch.

One program per (row, value head, V block) loads its [K, BV] slice of the committed fp32 state, walks the row's
first n_accept[b] stored positions with the decode kernel's state update, op for op and with its block shape
(k3_kernels.kda.fused_recurrent: S <- S * e^g; u = v - S^T k; S += beta k u^T; BK = next_pow2(K),
BV = min(32, next_pow2(V)), 4 warps), and writes the result: the state decode would reach. No outputs are formed.
The reference (the spec) is `naive.py`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3_kernels.launch import cdiv, next_pow2

from .naive import check_replay_inputs


@triton.jit
def _replay_commit(state, k, v, g, beta, n_accept, out, B, H, HV, K, V, BK: tl.constexpr, BV: tl.constexpr):
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
    S = tl.zeros([BK, BV], dtype=tl.float32)
    S += tl.load(state + ps, mask=mkv, other=0.)
    n = tl.load(n_accept + b).to(tl.int64)
    for t in range(0, n):
        row = t * B + b
        kt = tl.load(k + (row * H + h) * K + ok, mask=km, other=0.).to(tl.float32)
        vt = tl.load(v + (row * HV + hv) * V + ov, mask=vm, other=0.).to(tl.float32)
        gt = tl.load(g + (row * HV + hv) * K + ok, mask=km, other=0.).to(tl.float32)
        bt = tl.load(beta + row * HV + hv).to(tl.float32)
        S = S * tl.exp(gt)[:, None]
        u = vt - tl.sum(kt[:, None] * S, 0)
        S += (bt * kt)[:, None] * u[None, :]
    tl.store(out + ps, S, mask=mkv)


def replay_commit(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  n_accept: torch.Tensor, n_accept_checked: bool = False) -> torch.Tensor:
    """Same contract as `naive_replay_commit`: state [B, HV, K, V] fp32 (not modified); k [T, B, H, K];
    v [T, B, HV, V]; g [T, B, HV, K]; beta [T, B, HV]; n_accept [B] -> the new state [B, HV, K, V].
    `n_accept_checked`: see `check_replay_inputs` (then nothing syncs: the call can be captured)."""
    check_replay_inputs(state, k, v, g, beta, n_accept, n_accept_checked)
    B, HV, K, V = state.shape
    H = k.shape[2]
    if not (1 <= K <= 256 and 1 <= V <= 256):
        raise ValueError(f"state: head dims must be in [1, 256], got K={K}, V={V}")
    state, k, v, g, beta = (x.contiguous() for x in (state, k, v, g, beta))
    n = n_accept.to(device=state.device, dtype=torch.int32).contiguous()
    out = torch.empty_like(state)
    if B == 0:
        return out
    BK, BV = next_pow2(K), min(32, next_pow2(V))
    _replay_commit[(B, HV, cdiv(V, BV))](state, k, v, g, beta, n, out, B, H, HV, K, V, BK=BK, BV=BV, num_warps=4)
    return out
