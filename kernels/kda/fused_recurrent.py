"""Token-by-token KDA decode in Triton (forward only), with in-place state-pool updates.

One program per (sequence, value head, V block; V blocks adjacent in the launch) keeps its [K, BV] slice of the
fp32 state in registers and walks the sequence's few tokens: S <- diag(e^g) S; S += beta k (v - S^T k)^T;
o = S^T (scale q).
With `ssm_state_indices`, sequence n reads `initial_state[ssm_state_indices[n]]` and writes its final state back
to the same slot (a rollout engine's state pool). Structure follows fla-core 0.6.0
`fla/ops/kda/fused_recurrent.py` (read, not copied).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3_kernels.launch import cdiv

from .checks import check_beta_options, check_cu_seqlens, check_gate, check_shapes, check_state, state_layout
from .gate import GATE_NONE, gate_activation, gate_mode
from .plan import pow2_tile


DECODE_STAGES = 2   # the token loop's software-pipelining depth (1: not pipelined); benchmarks/kda.py --decode A/Bs it
# q, k and beta of token t + 1 loaded by hand during token t (the pipeliner leaves them: 2 bytes a thread, under
# cp.async's 4); same bits either way; benchmarks/kda.py --decode A/Bs it (kernels/kda/NOTES.md, session 37)
DECODE_PREFETCH_QK = True


@triton.jit
def _recurrent_fwd(q, k, v, g, beta, A_log, dt_bias, o, h0, ht, cu, idx, scale, lower_bound, T, P,
                   H, HV, K, V, BK: tl.constexpr,
                   BV: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr,
                   L2NORM: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, VARLEN: tl.constexpr,
                   HAS_IDX: tl.constexpr, BETA_LOGIT_SCALE: tl.constexpr, STATE_V_FIRST: tl.constexpr,
                   STAGES: tl.constexpr, PREFETCH_QK: tl.constexpr):
    # one axis, V blocks fastest: the programs that read and write the columns of one state's rows run side by
    # side (a state's [K, V] rows are V * 4 bytes; one V block alone reads a quarter of each row)
    pid = tl.program_id(0).to(tl.int64)
    NV = tl.cdiv(V, BV)
    iv = pid % NV
    hv = (pid // NV) % HV
    n = pid // (NV * HV)
    h = hv // (HV // H)
    if VARLEN:  # clamped to the T tokens there are: a bad device-side cu_seqlens cannot reach past them
        bos = tl.minimum(tl.maximum(tl.load(cu + n).to(tl.int64), 0), T)
        eos = tl.minimum(tl.maximum(tl.load(cu + n + 1).to(tl.int64), bos), T)
    else:
        bos = n * T
        eos = bos + T
    slot = n
    if HAS_IDX:
        slot = tl.load(idx + n).to(tl.int64)
        slot = tl.where(slot < P, slot, -1)  # past the pool's P slots: a padding row, as a negative index
    ok = tl.arange(0, BK)
    km = ok < K
    ov = iv * BV + tl.arange(0, BV)
    vm = ov < V
    mkv = km[:, None] & vm[None, :]
    live = mkv & ((ov[None, :] * 0 + slot) >= 0)  # negative slot: padding row, no state read or written
    if STATE_V_FIRST:  # state [.., V, K] (SGLang's pools)
        ps = (slot * HV + hv) * K * V + ov[None, :] * K + ok[:, None]
    else:
        ps = (slot * HV + hv) * K * V + ok[:, None] * V + ov[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + ps, mask=live, other=0.)
    if GATE != GATE_NONE:
        if HAS_DT:
            bias = tl.load(dt_bias + hv * K + ok, mask=km, other=0.).to(tl.float32)
        a_exp = 1.
        if HAS_A:
            a_exp = tl.exp(tl.load(A_log + hv).to(tl.float32))
    if PREFETCH_QK:  # the first token's q, k and beta loaded before the loop, token t + 1's during token t
        q_next = tl.load(q + (bos * H + h) * K + ok, mask=km & (bos < eos), other=0.)
        k_next = tl.load(k + (bos * H + h) * K + ok, mask=km & (bos < eos), other=0.)
        b_next = tl.load(beta + bos * HV + hv, mask=bos < eos, other=0.)
    # STAGES > 1: the loop software-pipelined (token t + 1's loads issued while token t's update runs); the
    # arithmetic is the same, so are the bits
    for t in tl.range(bos, eos, num_stages=STAGES):
        if PREFETCH_QK:
            qt, kt, bt = q_next.to(tl.float32), k_next.to(tl.float32), b_next.to(tl.float32)
            q_next = tl.load(q + ((t + 1) * H + h) * K + ok, mask=km & (t + 1 < eos), other=0.)
            k_next = tl.load(k + ((t + 1) * H + h) * K + ok, mask=km & (t + 1 < eos), other=0.)
            b_next = tl.load(beta + (t + 1) * HV + hv, mask=t + 1 < eos, other=0.)
        else:
            qt = tl.load(q + (t * H + h) * K + ok, mask=km, other=0.).to(tl.float32)
            kt = tl.load(k + (t * H + h) * K + ok, mask=km, other=0.).to(tl.float32)
        if L2NORM:
            qt = qt / tl.sqrt(tl.sum(qt * qt, 0) + 1e-6)
            kt = kt / tl.sqrt(tl.sum(kt * kt, 0) + 1e-6)
        vt = tl.load(v + (t * HV + hv) * V + ov, mask=vm, other=0.).to(tl.float32)
        gt = tl.load(g + (t * HV + hv) * K + ok, mask=km, other=0.).to(tl.float32)
        if GATE != GATE_NONE:
            if HAS_DT:
                gt = gt + bias
            gt = gate_activation(gt, a_exp, lower_bound, GATE, HAS_A)
        if not PREFETCH_QK:
            bt = tl.load(beta + t * HV + hv).to(tl.float32)
        if BETA_LOGIT_SCALE != 0:  # beta given as logits: beta = scale * sigmoid (2 with allow_neg_eigval)
            bt = BETA_LOGIT_SCALE * tl.sigmoid(bt)
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
                        use_gate_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
                        allow_neg_eigval: bool = False, lower_bound: float | None = None,
                        state_v_first: bool = False, cu_seqlens: torch.Tensor | None = None, *,
                        ssm_state_indices: torch.Tensor | None = None, inplace_final_state: bool | None = None,
                        transpose_state_layout: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decode a few tokens per sequence (forward only); fla-core 0.6.0's `fused_recurrent_kda` signature.

    q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] (log-decay, or the raw gate input with `use_gate_in_kernel`,
    K3's safe gate when `lower_bound` is set); beta [B, T, HV] (logits with `use_beta_sigmoid_in_kernel`: sigmoid,
    or 2 sigmoid with `allow_neg_eigval`); `cu_seqlens` packs N sequences (B = 1); states [.., HV, K, V] fp32, or
    [.., HV, V, K] with `state_v_first` (read and written in that layout by the kernel).
    State pool mode: with `ssm_state_indices` (int [N]), `initial_state` is a pool [P, HV, K, V] fp32; sequence n
    starts from `initial_state[ssm_state_indices[n]]` and its final state is written back to that slot in place
    (`inplace_final_state` defaults to True then); a negative index means a padding row: zero start, no write.
    Slots must be distinct. No call syncs with the device: device-side `cu_seqlens` and `ssm_state_indices` are
    checked by shape and dtype, their values bounded in the kernel (boundaries clamped to the tokens, an index past
    the pool a padding row); host-side ones are checked in full (ValueError). Returns (o [B, T, HV, V] in v.dtype, final state: the pool when in place, else a new
    [N, HV, K, V] fp32 tensor or None).
    """
    state_v_first = state_layout(state_v_first, transpose_state_layout)
    B, T, H, HV, K, V = check_shapes(q, k, v, g, beta)
    check_beta_options(use_beta_sigmoid_in_kernel, allow_neg_eigval)
    check_gate(use_gate_in_kernel, A_log, dt_bias, lower_bound, HV, K)
    if cu_seqlens is not None and cu_seqlens.device.type != q.device.type:
        raise ValueError(f"cu_seqlens must be on q's device ({q.device}), got {cu_seqlens.device}")
    if cu_seqlens is not None and cu_seqlens.device.type == "cpu":
        check_cu_seqlens(cu_seqlens, None, B, T)  # values too: no device sync on the host
    elif cu_seqlens is not None and (B != 1 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2
                                     or cu_seqlens.dtype.is_floating_point):
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor [N+1] with B = 1, got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)} with B = {B}")
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if inplace_final_state is None:
        inplace_final_state = ssm_state_indices is not None
    if ssm_state_indices is not None:
        if ssm_state_indices.shape != (N,) or ssm_state_indices.dtype.is_floating_point:
            raise ValueError(f"ssm_state_indices must be integer [N] = [{N}], got {ssm_state_indices.dtype} "
                             f"{tuple(ssm_state_indices.shape)}")
        if initial_state is None:
            raise ValueError("ssm_state_indices needs initial_state (the state pool [P, HV, K, V])")
    if initial_state is not None:
        pooled = ssm_state_indices is not None
        check_state(initial_state, initial_state.shape[0] if pooled else N, HV, K, V, state_v_first,
                    "P" if pooled else "N")
        if inplace_final_state and not initial_state.is_contiguous():
            raise ValueError("initial_state must be contiguous to be updated in place")
        if pooled and ssm_state_indices.device.type == "cpu" and ssm_state_indices.numel() \
                and int(ssm_state_indices.max()) >= initial_state.shape[0]:  # (a device tensor: the kernel masks)
            raise ValueError(f"ssm_state_indices must be < the pool's {initial_state.shape[0]} slots, got "
                             f"{int(ssm_state_indices.max())}")
    if inplace_final_state and initial_state is None:
        raise ValueError("inplace_final_state needs initial_state")
    scale = K ** -0.5 if scale is None else float(scale)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    h0 = initial_state.contiguous() if initial_state is not None else None
    idx = ssm_state_indices
    if inplace_final_state:
        ht = initial_state
    elif output_final_state:
        ht = q.new_empty((N, HV, V, K) if state_v_first else (N, HV, K, V), dtype=torch.float32)
        if idx is not None:  # gather the slots' states first; row n of the result belongs to sequence n
            h0 = (initial_state[idx.clamp_min(0)] * (idx >= 0).view(-1, 1, 1, 1)).contiguous()
            idx = None
    else:
        ht = None
    o = torch.empty_like(v)
    if o.numel() == 0 and ht is None:
        return o, ht
    BK, BV = pow2_tile(K), min(32, pow2_tile(V))
    gate = gate_mode(use_gate_in_kernel, lower_bound)
    dummy = o
    _recurrent_fwd[(N * HV * cdiv(V, BV),)](
        q, k, v, g, beta, A_log.contiguous() if A_log is not None else dummy,
        dt_bias.contiguous() if dt_bias is not None else dummy,
        o, h0 if h0 is not None else dummy, ht if ht is not None else dummy,
        cu_seqlens if cu_seqlens is not None else dummy, idx if idx is not None else dummy,
        scale, float(lower_bound) if lower_bound is not None else 0., T,
        initial_state.shape[0] if initial_state is not None else 0,
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, GATE=gate, HAS_A=A_log is not None, HAS_DT=dt_bias is not None,
        L2NORM=use_qk_l2norm_in_kernel, HAS_H0=h0 is not None, STORE_HT=ht is not None,
        VARLEN=cu_seqlens is not None, HAS_IDX=idx is not None,
        BETA_LOGIT_SCALE=(2 if allow_neg_eigval else 1) if use_beta_sigmoid_in_kernel else 0,   # 0: beta as given
        STATE_V_FIRST=state_v_first, STAGES=DECODE_STAGES, PREFETCH_QK=DECODE_PREFETCH_QK, num_warps=4)
    return o, ht
