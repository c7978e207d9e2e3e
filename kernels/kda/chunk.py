"""Chunked KDA in Triton: forward and backward (autograd), FLA-compatible `chunk_kda`.

Math (per head, chunk C = 64, G = in-chunk cumulative log-decay, q~ = scale * q), as in `naive_chunk_kda`:
  A[i,j]   = beta_i <k_i e^{G_i-G_j}, k_j>  (i > j),   M = (I + A)^-1
  W = M (beta k e^G),  U = M (beta v),  Aqk[i,j] = <q~_i e^{G_i-G_j}, k_j> (j <= i)
  v' = U - W S,  o = (q~ e^G) S + Aqk v',  S <- e^{G_C} S + (k e^{G_C-G})^T v'

Kernels (layout and staging ideas from fla-core 0.6.0 `fla/ops/kda/chunk_intra.py`, `fla/ops/common/chunk_delta_h.py`,
`fla/ops/kda/chunk_bwd.py`; written independently, no code copied). Forward:
  `_fwd_cumsum` (chunk, head, K slice): fused gate activation + in-chunk cumsum G.
  `_fwd_intra` (chunk, head), two launches: A and Aqk with 64-row tensor-core dots, summed over K slices; a chunk
     whose channels each span at most 80 of log-decay as one pair of dots per slice around each channel's midpoint
     (the launch with WHOLE set), any other chunk as 16-row blocks (the other launch): off-diagonal blocks per
     column block J around G at J's last row, so both exponential factors are <= 1, diagonal blocks around their
     middle rows when every |G - G_mid| <= 40 (always for K3's gate), else exactly; then M = (I + A)^-1 in a
     product form of ten 64 x 64 x 64 dots, W, U, q e^G, k e^{G_C-G}; on CUDA each exponential is one
     `ex2.approx.ftz` (`_exp2`). (FLA splits this into three kernels of 16-row tiles.)
  `_fwd_state` (sequence, head, V block): the serial pass over chunks. The columns of the state evolve
     independently (v' = U - W S is column-wise), so splitting V gives B*HV*V/BV programs instead of B*HV;
     the output is fused into the pass, so in inference the per-chunk states never reach memory. A packed batch
     whose sequences fall into classes by length (`_state_classes`, longest first) is done class by class:
     cumsum and intra of a class, then its state pass on a high-priority side stream of its own (`_forked`) while
     the later classes' work runs on the current stream (the last class's pass too); a forked pass takes wide V
     blocks (few programs: most multiprocessors stay with the later classes' intra work; CONFIG
     `fwd_state_forked_*`). A class of one sequence may also be cut into time segments (CONFIG `fwd_segments`,
     `plan.segment_bounds`): segment s's pass on the side stream (its state handed to segment s + 1's in fp32,
     the same bits) while segment s + 1's cumsum and intra work run on the current stream.
Backward: `_bwd_state` (reverse pass for dS and dv', same V split; a packed batch's classes at once, each but the
last on a side stream; a batch of one sequence optionally in time segments, `bwd_segments`: segment s's prep and
intra work beside segment s - 1's pass), `_bwd_prep` (chunk, head: dv, dbeta, dAqk,
dA = -M^T dM M^T and the direct parts of dq, dk, dG), `_bwd_intra` (chunk, head: the gradients through the
gated products, K slice by K slice, and the reverse in-chunk cumsum for dg; writes dq, dk, dg): a chunk whose
log-decay spans at most 80 per channel as 64-row dots around each channel's midpoint (`_bwd_whole`), any other as
16 x 16 blocks (`_bwd_blocks`; a 64-row version with per-block factors like the forward's measured slower:
kernels/kda/NOTES.md).
Every reduction has a fixed order and there are no atomics: results are bitwise reproducible.
Intermediates live in a chunk-padded layout [chunks, HV, 64, D] so that later kernels need no row masks.

Files (FLA's split): chunk.py (this: autograd Function, checks, public API), chunk_fwd.py (cumsum, state pass, `_fwd`),
chunk_intra.py (forward intra), chunk_bwd.py (state pass, prep, `_bwd`), chunk_bwd_intra.py (backward intra),
utils.py (Triton helpers), plan.py (CONFIG, chunk plan, sequence classes, side streams).
"""
from __future__ import annotations

import torch

from .chunk_bwd import _bwd
from .chunk_fwd import _fwd
from .checks import (activate_beta, check_beta_options, check_cu_seqlens, check_gate, check_shapes, check_state,
                     state_layout)
from .gate import GATE_DEFAULT, GATE_NONE, gate_backward, gate_mode
from .intermediate import intermediate_states
from .naive import l2norm, naive_kda_gate, naive_kda_lowerbound_gate
from .plan import BT, CONFIG, _chunk_plan, _prec, _state_classes, _state_split  # noqa: F401 (tests, benchmarks)
from .plan import tile_dims


class _ChunkKDA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, h0, want_ht, gate, A_log, dt_bias, lower_bound, cu):
        plan = _chunk_plan(cu, q.shape[0], q.shape[1], q.device)
        o, ht, saved = _fwd(q, k, v, g, beta, scale, h0, want_ht, gate, A_log, dt_bias, lower_bound, plan, True)
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, *saved)
        ctx.plan, ctx.scale, ctx.gate, ctx.lower_bound, ctx.has_h0 = plan, scale, gate, lower_bound, h0 is not None
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, A_log, dt_bias, *saved = ctx.saved_tensors
        dq, dk, dv, dg, dbeta, dh0 = _bwd(q, k, v, beta, do.contiguous(), dht.contiguous() if dht is not None else None,
                                          ctx.has_h0, ctx.scale, saved, ctx.plan)
        dA_log = ddt = None
        if ctx.gate != GATE_NONE and CONFIG["gate_bwd"] == "triton":  # the gate's backward as one pass (gate.py)
            dg, dA_log, ddt = gate_backward(g, dg, A_log, dt_bias, ctx.gate, ctx.lower_bound)
        elif ctx.gate != GATE_NONE:  # torch autograd over the reference gate (elementwise; torch's fixed-order reductions)
            with torch.enable_grad():
                inputs = [x.detach().requires_grad_(True) if x is not None else None for x in (g, A_log, dt_bias)]
                if ctx.gate == GATE_DEFAULT:
                    ga = naive_kda_gate(inputs[0], inputs[1], inputs[2])
                else:
                    ga = naive_kda_lowerbound_gate(inputs[0], inputs[1], inputs[2], ctx.lower_bound)
                live = [x for x in inputs if x is not None]
                grads = iter(torch.autograd.grad(ga, live, dg))
                dg, dA_log, ddt = (next(grads) if x is not None else None for x in inputs)
        return (dq, dk, dv, dg.to(g.dtype), dbeta, None, dh0, None, None, dA_log, ddt, None, None)


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              scale: float | None = None, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
              use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
              use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False, safe_gate: bool = False,
              lower_bound: float | None = None, disable_recompute: bool = False,
              return_intermediate_states: bool = False, state_v_first: bool = False,
              cu_seqlens: torch.Tensor | None = None, cu_seqlens_cpu: torch.Tensor | None = None,
              cp_context=None, use_graph: bool = False, max_num_seqs: int | None = None, *,
              A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None, chunk_size: int = 64,
              transpose_state_layout: bool | None = None):
    """KDA over whole sequences (prefill / training), differentiable; fla-core 0.6.0's `chunk_kda` signature.

    q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] (log-decay, or the raw gate input when
    `use_gate_in_kernel`: `-exp(A_log) softplus(g + dt_bias)`, or K3's safe gate
    `lower_bound * sigmoid(exp(A_log) (g + dt_bias))` when `lower_bound` is set; `safe_gate` checks that
    lower_bound is in [-5, 0)); beta [B, T, HV] (logits with `use_beta_sigmoid_in_kernel`: sigmoid(beta), or
    2 sigmoid(beta) with `allow_neg_eigval`); initial_state [N, HV, K, V] fp32 ([N, HV, V, K] with `state_v_first`,
    the final state too); `cu_seqlens` int [N+1] packs N sequences into B = 1 (`cu_seqlens_cpu`, a host copy, saves
    a device sync). Head dims up to 256, any size (tiles are padded to powers of two and masked).
    `chunk_size` (32 or 64) only sets the spacing of `return_intermediate_states`' states: the kernels always work on
    64-token chunks (the result is the same function). `disable_recompute` is accepted and changes nothing: these
    kernels never recompute (the forward saves what the backward reads).
    `return_intermediate_states` (inference, no autograd): also returns h [B, NT, HV, K, V] in k's dtype, the state
    before each chunk of `chunk_size` tokens (NT = ceil(T / chunk_size); packed: B = 1 and NT sums over the
    sequences, in order). `cp_context` and `use_graph` (context parallelism, CUDA-graph replay) are not supported:
    ValueError. Returns (o [B, T, HV, V] in v.dtype, final state fp32 or None[, h])."""
    state_v_first = state_layout(state_v_first, transpose_state_layout)
    B, T, H, HV, K, V = check_shapes(q, k, v, g, beta)
    if cp_context is not None:
        raise ValueError("cp_context: context parallelism is not supported by k3_kernels' chunk_kda")
    if use_graph:
        raise ValueError("use_graph: CUDA-graph capture of the packed plan is not supported by k3_kernels' chunk_kda "
                         "(the plan is built from cu_seqlens on the host)")
    if chunk_size not in (32, 64):
        raise ValueError(f"chunk_size must be 32 or 64, got {chunk_size}")
    check_beta_options(use_beta_sigmoid_in_kernel, allow_neg_eigval)
    check_gate(use_gate_in_kernel, A_log, dt_bias, lower_bound, HV, K, safe_gate)
    cu = check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, B, T)
    N = B if cu is None else len(cu) - 1
    check_state(initial_state, N, HV, K, V, state_v_first)
    tensors = (q, k, v, g, beta, initial_state, A_log, dt_bias)
    grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)
    if return_intermediate_states and grad:
        raise ValueError("return_intermediate_states is for inference (no autograd): run under torch.no_grad() / "
                         "torch.inference_mode(), or pass inputs that do not require grad")
    scale = K ** -0.5 if scale is None else float(scale)
    BK, BV = tile_dims(K, V, q.dtype, q.device)
    if (BK, BV) != (K, V):  # head dims the tiles do not fit exactly: zero-padded to them, results cut back
        return _padded(BK, BV, K, V, q, k, v, g, beta, scale, initial_state, output_final_state,
                       use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                       safe_gate, lower_bound, return_intermediate_states, state_v_first, cu_seqlens, cu_seqlens_cpu,
                       A_log, dt_bias, chunk_size)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    beta = activate_beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    gate = gate_mode(use_gate_in_kernel, lower_bound)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    h0 = initial_state
    if h0 is not None:
        h0 = (h0.transpose(-1, -2) if state_v_first else h0).contiguous()
    A_log = A_log.contiguous() if A_log is not None else None
    dt_bias = dt_bias.contiguous() if dt_bias is not None else None
    if grad:
        o, ht = _ChunkKDA.apply(q, k, v, g, beta, scale, h0, output_final_state, gate, A_log, dt_bias, lower_bound,
                                cu)
    else:  # inference: no autograd node, nothing saved (per-chunk states never reach memory) unless asked for
        plan = _chunk_plan(cu, B, T, q.device)
        o, ht, saved = _fwd(q, k, v, g, beta, scale, h0, output_final_state, gate, A_log, dt_bias, lower_bound,
                            plan, return_intermediate_states)
    if ht is not None and state_v_first:
        ht = ht.transpose(-1, -2).contiguous()
    if not return_intermediate_states:
        return o, ht
    return o, ht, intermediate_states(saved, k, plan, B, T, H, V, chunk_size, state_v_first)


def _padded(BK, BV, K, V, q, k, v, g, beta, scale, h0, output_final_state, l2, gate_in_kernel, beta_sigmoid, neg,
            safe_gate, lower_bound, intermediate, v_first, cu_seqlens, cu_seqlens_cpu, A_log, dt_bias, chunk_size):
    """chunk_kda at head dims K, V that are not the tiles' (BK, BV): q, k, g, dt_bias zero-padded to BK, v to BV,
    the initial state to [BK, BV]; the outputs cut back. Exact: a zero key channel never writes its state row and a
    zero query channel never reads it (the row stays zero whatever its decay), a zero value column stays zero, and
    l2 norms and the scale (taken from K) are unchanged. So every launch sees whole tiles: the masked partial tiles
    of 16-bit head dims 60 / 100 faulted on the H200 (illegal memory access, kernels/kda/NOTES.md)."""
    import torch.nn.functional as F
    dk, dv = BK - K, BV - V
    q, k, g = (F.pad(x, (0, dk)) for x in (q, k, g))
    v = F.pad(v, (0, dv))
    if h0 is not None:
        h0 = F.pad(h0, (0, dk, 0, dv) if v_first else (0, dv, 0, dk))
    if dt_bias is not None:
        dt_bias = F.pad(dt_bias.reshape(-1, K), (0, dk)).reshape(-1)
    out = chunk_kda(q, k, v, g, beta, scale, h0, output_final_state, l2, gate_in_kernel, beta_sigmoid, neg,
                    safe_gate, lower_bound, False, intermediate, v_first, cu_seqlens, cu_seqlens_cpu,
                    A_log=A_log, dt_bias=dt_bias, chunk_size=chunk_size)
    cut = (lambda x: x[..., :V, :K]) if v_first else (lambda x: x[..., :K, :V])
    o, ht = out[0][..., :V], (cut(out[1]).contiguous() if out[1] is not None else None)
    if not intermediate:
        return o, ht
    return o, ht, cut(out[2]).contiguous()
