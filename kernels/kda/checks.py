"""Argument checks of `chunk_kda` and `fused_recurrent_kda` (fla-core 0.6.0's signatures), run before any work: each
error is a ValueError that names the offending argument or tensor, so nothing is launched on bad input."""
from __future__ import annotations

import warnings

import torch

from k3_kernels.elementwise import position_invariant

MAX_HEAD_DIM = 256  # fla-core's limit for K (and the widest state tile our kernels are built for)
MAX_CUDA_HEAD_DIM = 128  # the largest head dim run fwd + bwd on the H200 without a fault (60, 100, 128)


def state_layout(state_v_first: bool, transpose_state_layout: bool | None) -> bool:
    """`state_v_first`, or fla's deprecated name for it (`transpose_state_layout`, with its warning)."""
    if transpose_state_layout is None:
        return state_v_first
    if state_v_first:
        raise ValueError("pass either state_v_first or the deprecated transpose_state_layout, not both")
    warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.", DeprecationWarning,
                  stacklevel=3)
    return bool(transpose_state_layout)


def check_beta_options(use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool) -> None:
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True (beta = 2 sigmoid(beta))")


def activate_beta(beta: torch.Tensor, use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool) -> torch.Tensor:
    """beta as the kernels take it: the given values, or sigmoid(beta) (2 sigmoid(beta) with `allow_neg_eigval`:
    eigenvalues of the transition in (-1, 1]), in fp32 and back to beta's dtype, differentiable, elementwise
    (deterministic; batch invariant on CPU too: `position_invariant`)."""
    if not use_beta_sigmoid_in_kernel:
        return beta
    b = position_invariant(torch.sigmoid, beta.float())
    return (2. * b if allow_neg_eigval else b).to(beta.dtype)


def check_shapes(q, k, v, g, beta) -> tuple[int, int, int, int, int, int]:
    """(B, T, H, HV, K, V) of FLA's layouts, or a ValueError naming the tensor or head dim."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(x).__name__}")
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must be [B, T, H, K] of one shape, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B, T, HV, V] with B={B}, T={T}, got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or HV % H or HV == 0:
        raise ValueError(f"v heads (HV={HV}) must be a positive multiple of q/k heads (H={H})")
    for name, d in (("K (q/k head dim)", K), ("V (v head dim)", V)):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"head dim {name} = {d} is not supported: it must be in [1, {MAX_HEAD_DIM}]")
    if g.shape != (B, T, HV, K):
        raise ValueError(f"g must be [B, T, HV, K] = {(B, T, HV, K)}, got {tuple(g.shape)}")
    if beta.shape != (B, T, HV):
        raise ValueError(f"beta must be [B, T, HV] = {(B, T, HV)}, got {tuple(beta.shape)}")
    if len({x.device for x in (q, k, v, g, beta)}) != 1:
        raise ValueError("q, k, v, g, beta must be on one device")
    if q.device.type == "cuda":
        for name, d in (("K (q/k head dim)", K), ("V (v head dim)", V)):
            if d > MAX_CUDA_HEAD_DIM:
                raise ValueError(f"head dim {name} = {d} is not supported on CUDA: at most {MAX_CUDA_HEAD_DIM} "
                                 f"(head dim 256 faulted in the chunk backward on the H200, kernels/kda/NOTES.md; "
                                 f"the interpreter path takes up to {MAX_HEAD_DIM})")
    return B, T, H, HV, K, V


def check_gate(use_gate_in_kernel: bool, A_log, dt_bias, lower_bound, HV: int, K: int,
               safe_gate: bool = False) -> None:
    if not use_gate_in_kernel:
        return
    if lower_bound is None and A_log is None:
        raise ValueError("A_log is required with use_gate_in_kernel=True unless lower_bound is set")
    if safe_gate:
        if lower_bound is None:
            raise ValueError("lower_bound must be set with safe_gate=True and use_gate_in_kernel=True")
        if not -5 <= lower_bound < 0:
            raise ValueError(f"lower_bound must be in the safe range [-5, 0) with safe_gate=True, got {lower_bound}")
    if A_log is not None and A_log.numel() != HV:
        raise ValueError(f"A_log must have HV={HV} elements, got {A_log.numel()}")
    if dt_bias is not None and dt_bias.numel() != HV * K:
        raise ValueError(f"dt_bias must have HV*K={HV * K} elements, got {dt_bias.numel()}")


def check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, B: int, T: int) -> tuple[int, ...] | None:
    """The packed batch's boundaries as a host tuple (from `cu_seqlens_cpu` when given: no device sync), checked."""
    if cu_seqlens is None:
        return None
    if B != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1, got B={B}")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
            or cu_seqlens.dtype.is_floating_point:
        raise ValueError("cu_seqlens must be a 1-D integer tensor [N+1]")
    host = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
    cu = tuple(int(x) for x in host.tolist())
    if len(cu) != cu_seqlens.numel():
        raise ValueError(f"cu_seqlens_cpu has {len(cu)} entries, cu_seqlens {cu_seqlens.numel()}")
    if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T={T}, got {cu}")
    return cu


def check_state(initial_state, rows: int, HV: int, K: int, V: int, state_v_first: bool, rows_name: str = "N"):
    if initial_state is None:
        return
    shape = (rows, HV, V, K) if state_v_first else (rows, HV, K, V)
    layout = "[%s, HV, V, K]" % rows_name if state_v_first else "[%s, HV, K, V]" % rows_name
    if not isinstance(initial_state, torch.Tensor) or initial_state.shape != shape \
            or initial_state.dtype != torch.float32:
        got = f"{initial_state.dtype} {tuple(initial_state.shape)}" if isinstance(initial_state, torch.Tensor) \
            else type(initial_state).__name__
        raise ValueError(f"initial_state must be fp32 {layout} = {shape}, got {got}")
