"""Token-by-token KDA decode in Triton (forward only), with in-place state-pool updates.

One program per (sequence, value head, V block) keeps its [K, BV] slice of the fp32 state in registers and
walks the sequence's few tokens: S <- diag(e^g) S; S += beta k (v - S^T k)^T; o = S^T (scale q).
With `ssm_state_indices`, sequence n reads `initial_state[ssm_state_indices[n]]` and writes its final state back
to the same slot (a rollout engine's state pool). Structure follows fla-core 0.6.0
`fla/ops/kda/fused_recurrent.py` (read, not copied).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3_kernels.launch import cdiv

from .plan import _p2


@triton.jit
def _recurrent_fwd(q, k, v, g, beta, A_log, dt_bias, o, h0, ht, cu, idx, scale, lower_bound, T,
                   H, HV, K, V, BK: tl.constexpr,
                   BV: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr,
                   L2NORM: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, VARLEN: tl.constexpr,
                   HAS_IDX: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1).to(tl.int64)
    iv = tl.program_id(2)
    h = hv // (HV // H)
    if VARLEN:
        bos = tl.load(cu + n).to(tl.int64)
        eos = tl.load(cu + n + 1).to(tl.int64)
    else:
        bos = n * T
        eos = bos + T
    slot = n
    if HAS_IDX:
        slot = tl.load(idx + n).to(tl.int64)
    ok = tl.arange(0, BK)
    km = ok < K
    ov = iv * BV + tl.arange(0, BV)
    vm = ov < V
    mkv = km[:, None] & vm[None, :]
    live = mkv & ((ov[None, :] * 0 + slot) >= 0)  # negative slot: padding row, no state read or written
    ps = (slot * HV + hv) * K * V + ok[:, None] * V + ov[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + ps, mask=live, other=0.)
    if GATE != 0:
        if HAS_DT:
            bias = tl.load(dt_bias + hv * K + ok, mask=km, other=0.).to(tl.float32)
        if HAS_A:
            a_exp = tl.exp(tl.load(A_log + hv).to(tl.float32))
    for t in range(bos, eos):
        qt = tl.load(q + (t * H + h) * K + ok, mask=km, other=0.).to(tl.float32)
        kt = tl.load(k + (t * H + h) * K + ok, mask=km, other=0.).to(tl.float32)
        if L2NORM:
            qt = qt / tl.sqrt(tl.sum(qt * qt, 0) + 1e-6)
            kt = kt / tl.sqrt(tl.sum(kt * kt, 0) + 1e-6)
        vt = tl.load(v + (t * HV + hv) * V + ov, mask=vm, other=0.).to(tl.float32)
        gt = tl.load(g + (t * HV + hv) * K + ok, mask=km, other=0.).to(tl.float32)
        if GATE != 0 and HAS_DT:
            gt = gt + bias
        if GATE == 1:
            gt = -a_exp * tl.where(gt > 20., gt, tl.log(1. + tl.exp(tl.minimum(gt, 20.))))
        elif GATE == 2:
            if HAS_A:
                gt = gt * a_exp
            gt = lower_bound * tl.sigmoid(gt)
        bt = tl.load(beta + t * HV + hv).to(tl.float32)
        S = S * tl.exp(gt)[:, None]
        u = vt - tl.sum(kt[:, None] * S, 0)
        S += (bt * kt)[:, None] * u[None, :]
        ot = tl.sum((qt * scale)[:, None] * S, 0)
        tl.store(o + (t * HV + hv) * V + ov, ot.to(o.dtype.element_ty), mask=vm)
    if STORE_HT:
        tl.store(ht + ps, S, mask=live)


def fused_recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                        scale: float | None = None, initial_state: torch.Tensor | None = None,
                        output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                        use_gate_in_kernel: bool = False, lower_bound: float | None = None,
                        cu_seqlens: torch.Tensor | None = None, ssm_state_indices: torch.Tensor | None = None,
                        inplace_final_state: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decode a few tokens per sequence (forward only; FLA's `fused_recurrent_kda` layouts and gates).

    q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV]; `cu_seqlens` packs N sequences (B = 1).
    State pool mode: with `ssm_state_indices` (int [N]), `initial_state` is a pool [P, HV, K, V] fp32; sequence n
    starts from `initial_state[ssm_state_indices[n]]` and its final state is written back to that slot in place
    (`inplace_final_state` defaults to True then); a negative index means a padding row: zero start, no write.
    Slots must be distinct. Returns (o [B, T, HV, V] in v.dtype, final state: the pool when in place, else a new
    [N, HV, K, V] fp32 tensor or None).
    """
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must be [B, T, H, K] of one shape, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:2] != (B, T) or v.shape[2] % H:
        raise ValueError(f"v must be [B, T, HV, V] with HV a multiple of H={H}, got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if g.shape != (B, T, HV, K) or beta.shape != (B, T, HV):
        raise ValueError(f"g must be {(B, T, HV, K)} and beta {(B, T, HV)}, got {tuple(g.shape)}, {tuple(beta.shape)}")
    if not (1 <= K <= 256 and 1 <= V <= 256):
        raise ValueError(f"head dims must be in [1, 256], got K={K}, V={V}")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1, got B={B}")
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if use_gate_in_kernel and A_log is None and lower_bound is None:
        raise ValueError("A_log is required with use_gate_in_kernel=True unless lower_bound is set")
    if inplace_final_state is None:
        inplace_final_state = ssm_state_indices is not None
    if ssm_state_indices is not None:
        if ssm_state_indices.shape != (N,):
            raise ValueError(f"ssm_state_indices must be [N] = [{N}], got {tuple(ssm_state_indices.shape)}")
        if initial_state is None:
            raise ValueError("ssm_state_indices needs initial_state (the state pool [P, HV, K, V])")
    if initial_state is not None:
        rows = initial_state.shape[0] if ssm_state_indices is not None else N
        if initial_state.shape != (rows, HV, K, V) or initial_state.dtype != torch.float32:
            raise ValueError(f"initial_state must be fp32 [{'P' if ssm_state_indices is not None else 'N'}, HV, K, V]"
                             f" = {(rows, HV, K, V)}, got {initial_state.dtype} {tuple(initial_state.shape)}")
        if inplace_final_state and not initial_state.is_contiguous():
            raise ValueError("initial_state must be contiguous to be updated in place")
    if inplace_final_state and initial_state is None:
        raise ValueError("inplace_final_state needs initial_state")
    scale = K ** -0.5 if scale is None else float(scale)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    h0 = initial_state.contiguous() if initial_state is not None else None
    idx = ssm_state_indices
    if inplace_final_state:
        ht = initial_state
    elif output_final_state:
        ht = q.new_empty(N, HV, K, V, dtype=torch.float32)
        if idx is not None:  # gather the slots' states first; row n of the result belongs to sequence n
            h0 = (initial_state[idx.clamp_min(0)] * (idx >= 0).view(-1, 1, 1, 1)).contiguous()
            idx = None
    else:
        ht = None
    o = torch.empty_like(v)
    BK, BV = _p2(K), min(32, _p2(V))
    gate = 0 if not use_gate_in_kernel else (2 if lower_bound is not None else 1)
    dummy = o
    _recurrent_fwd[(N, HV, cdiv(V, BV))](
        q, k, v, g, beta, A_log if A_log is not None else dummy, dt_bias if dt_bias is not None else dummy,
        o, h0 if h0 is not None else dummy, ht if ht is not None else dummy,
        cu_seqlens if cu_seqlens is not None else dummy, idx if idx is not None else dummy,
        scale, float(lower_bound) if lower_bound is not None else 0., T,
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, GATE=gate, HAS_A=A_log is not None, HAS_DT=dt_bias is not None,
        L2NORM=use_qk_l2norm_in_kernel, HAS_H0=h0 is not None, STORE_HT=ht is not None,
        VARLEN=cu_seqlens is not None, HAS_IDX=idx is not None, num_warps=4)
    return o, ht
