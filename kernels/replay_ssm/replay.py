"""ReplaySSM commit for KDA in Triton: fold each row's accepted step inputs into its committed state in one launch.

One program per (row, value head, V block) loads its [K, BV] slice of the committed fp32 state, walks the row's
first n_accept[b] stored positions with the decode kernel's state update, op for op and with its block shape
(k3_kernels.kda.fused_recurrent: S <- S * e^g; u = v - S^T k; S += beta k u^T; BK = next_pow2(K),
BV = min(32, next_pow2(V)), 4 warps), and writes the result: the state decode would reach. No outputs are formed.
`replay_commit_into` does the same on a state pool's rows in place (the engine's commit: no gather, no scatter).
The reference (the spec) is `naive.py`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3_kernels.launch import cdiv, next_pow2

from .naive import check_replay_inputs, check_state_rows


@triton.jit
def _replay_commit(state, rows, k, v, g, beta, n_accept, out, B, H, HV, K, V, BK: tl.constexpr, BV: tl.constexpr,
                   IN_PLACE: tl.constexpr):
    """IN_PLACE: row b's state is state[rows[b]], written back there (out unused), and not at all when
    n_accept[b] = 0; otherwise state[b] -> out[b]."""
    pid = tl.program_id(0).to(tl.int64)   # one axis, V blocks fastest (as the decode kernel's launch)
    NV = tl.cdiv(V, BV)
    iv = pid % NV
    hv = (pid // NV) % HV
    b = pid // (NV * HV)
    h = hv // (HV // H)
    ok = tl.arange(0, BK)
    km = ok < K
    ov = iv * BV + tl.arange(0, BV)
    vm = ov < V
    mkv = km[:, None] & vm[None, :]
    n = tl.load(n_accept + b).to(tl.int64)
    if IN_PLACE:
        sb = tl.load(rows + b).to(tl.int64)
        mkv = mkv & (n > 0)
    else:
        sb = b
    ps = (sb * HV + hv) * K * V + ok[:, None] * V + ov[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    S += tl.load(state + ps, mask=mkv, other=0.)
    for t in range(0, n):
        row = t * B + b
        kt = tl.load(k + (row * H + h) * K + ok, mask=km, other=0.).to(tl.float32)
        vt = tl.load(v + (row * HV + hv) * V + ov, mask=vm, other=0.).to(tl.float32)
        gt = tl.load(g + (row * HV + hv) * K + ok, mask=km, other=0.).to(tl.float32)
        bt = tl.load(beta + row * HV + hv).to(tl.float32)
        S = S * tl.exp(gt)[:, None]
        u = vt - tl.sum(kt[:, None] * S, 0)
        S += (bt * kt)[:, None] * u[None, :]
    if IN_PLACE:
        tl.store(state + ps, S, mask=mkv)
    else:
        tl.store(out + ps, S, mask=mkv)


def _launch(state, rows, k, v, g, beta, n, out, B: int, in_place: bool) -> None:
    HV, K, V = state.shape[1:]
    if not (1 <= K <= 256 and 1 <= V <= 256):
        raise ValueError(f"state: head dims must be in [1, 256], got K={K}, V={V}")
    BK, BV = next_pow2(K), min(32, next_pow2(V))
    _replay_commit[(B * HV * cdiv(V, BV),)](state, rows, k, v, g, beta, n, out, B, k.shape[2], HV, K, V, BK=BK,
                                            BV=BV, IN_PLACE=in_place, num_warps=4)


def replay_commit(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  n_accept: torch.Tensor, n_accept_checked: bool = False) -> torch.Tensor:
    """Same contract as `naive_replay_commit`: state [B, HV, K, V] fp32 (not modified); k [T, B, H, K];
    v [T, B, HV, V]; g [T, B, HV, K]; beta [T, B, HV]; n_accept [B] -> the new state [B, HV, K, V].
    `n_accept_checked`: see `check_replay_inputs` (then nothing syncs: the call can be captured)."""
    check_replay_inputs(state, k, v, g, beta, n_accept, n_accept_checked)
    state, k, v, g, beta = (x.contiguous() for x in (state, k, v, g, beta))
    n = n_accept.to(device=state.device, dtype=torch.int32).contiguous()
    out = torch.empty_like(state)
    if state.shape[0]:
        _launch(state, n, k, v, g, beta, n, out, state.shape[0], in_place=False)   # (rows: unread when not in place)
    return out


def replay_commit_into(store: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, n_accept: torch.Tensor, checked: bool = False) -> None:
    """Same contract as `naive_replay_commit_into`: the states store[rows[b]] ([N, HV, K, V] fp32, contiguous)
    folded in place, each program reading its block before writing it back (rows with n_accept 0 untouched), so
    the pool is read and written once instead of gathered, folded and scattered. The same arithmetic as
    `replay_commit`, hence the same bits. `checked`: see `check_state_rows` (then nothing syncs)."""
    B = rows.shape[0] if rows.dim() == 1 else -1
    check_state_rows(store, rows, n_accept, checked)
    # the states' shape as replay_commit's `state` (a meta tensor: only its shape and dtype are checked)
    check_replay_inputs(torch.empty((B, *store.shape[1:]), dtype=store.dtype, device="meta"), k, v, g, beta,
                        n_accept, checked)
    if not store.is_contiguous():
        raise ValueError("store: must be contiguous (its rows are written in place)")
    k, v, g, beta = (x.contiguous() for x in (k, v, g, beta))
    n = n_accept.to(device=store.device, dtype=torch.int32).contiguous()
    rows = rows.to(device=store.device, dtype=torch.int64).contiguous()
    if B:
        _launch(store, rows, k, v, g, beta, n, store, B, in_place=True)
