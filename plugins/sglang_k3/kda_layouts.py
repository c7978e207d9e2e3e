"""KDA in SGLang's layouts on k3_kernels (torch + k3_kernels only: importable where SGLang is not, e.g. the GPU
machine). `kda_backend.K3KDAKernel` calls these; its docstrings say what SGLang passes.

State pool `[P, HV, V, K]` fp32 indexed by `cache_indices`; q, k [1, T, H, K], v [1, T, HV, V] packed by
`query_start_loc`; raw gate a [.., HV * K] and raw beta b [.., HV] (gate, sigmoid and the q/k l2-norm in kernel).
"""
from __future__ import annotations

import torch

from k3_kernels.kda import chunk_kda, fused_recurrent_kda


def _flat_gate(a: torch.Tensor, tokens: int, hv: int, k: int, name: str) -> torch.Tensor:
    if a.numel() != tokens * hv * k:
        raise ValueError(f"{name}: expected {tokens} x {hv} x {k} raw gate values, got shape {tuple(a.shape)}")
    return a.reshape(1, tokens, hv, k)


def _flat_beta(b: torch.Tensor, tokens: int, hv: int, name: str) -> torch.Tensor:
    if b.numel() != tokens * hv:
        raise ValueError(f"{name}: expected {tokens} x {hv} raw beta values, got shape {tuple(b.shape)}")
    return b.reshape(1, tokens, hv)


def _check_pool(ssm_states: torch.Tensor, hv: int, k: int, v: int) -> None:
    if ssm_states.dim() != 4 or tuple(ssm_states.shape[1:]) != (hv, v, k) or ssm_states.dtype != torch.float32:
        raise ValueError(f"ssm_states must be SGLang's fp32 pool [P, HV, V, K] = [P, {hv}, {v}, {k}], got "
                         f"{ssm_states.dtype} {tuple(ssm_states.shape)} (--mamba-ssm-dtype float32)")


def decode(q, k, v, a, b, *, A_log, dt_bias, ssm_states, cache_indices, query_start_loc,
           lower_bound: float | None = None) -> torch.Tensor:
    """One token per request; `ssm_states[cache_indices]` updated in place. Returns o [1, B, HV, V]."""
    _, tokens, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    _check_pool(ssm_states, HV, K, V)
    o, _ = fused_recurrent_kda(
        q, k, v, _flat_gate(a, tokens, HV, K, "decode a"), _flat_beta(b, tokens, HV, "decode b"),
        A_log=A_log, dt_bias=dt_bias, initial_state=ssm_states, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound,
        state_v_first=True, cu_seqlens=query_start_loc, ssm_state_indices=cache_indices.to(torch.int64),
        inplace_final_state=True)
    return o


def extend(q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, A_log, dt_bias,
           lower_bound: float | None = None, beta_is_raw: bool = True) -> torch.Tensor:
    """Packed prefill from the pool states; final states written back to the pool. Returns o [1, T, HV, V]."""
    _, tokens, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    _check_pool(ssm_states, HV, K, V)
    if A_log is None:
        raise ValueError("k3 KDA extend needs A_log / dt_bias: SGLang passes the raw gate (gate formed in kernel)")
    slots = cache_indices.to(torch.int64)
    h0 = ssm_states.index_select(0, slots)  # [N, HV, V, K]
    with torch.no_grad():
        o, ht = chunk_kda(
            q, k, v, _flat_gate(g, tokens, HV, K, "extend g"), _flat_beta(beta, tokens, HV, "extend beta"),
            initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=beta_is_raw, lower_bound=lower_bound, state_v_first=True,
            cu_seqlens=query_start_loc.to(torch.int64), A_log=A_log, dt_bias=dt_bias)
    ssm_states.index_copy_(0, slots, ht.to(ssm_states.dtype))
    return o


def target_verify(A_log, dt_bias, q, k, v, a, b, *, ssm_states, cache_indices, intermediate_states_buffer,
                  intermediate_state_indices, cache_steps: int, retrieve_parent_token: torch.Tensor | None,
                  lower_bound: float | None = None) -> torch.Tensor:
    """Speculative verify (chain, or a tree through `retrieve_parent_token`): the committed pool stays untouched;
    the state after draft token t goes to `intermediate_states_buffer[intermediate_state_indices[i], t]`."""
    _, tokens, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    D = int(cache_steps)
    _check_pool(ssm_states, HV, K, V)
    if D <= 0 or tokens % D:
        raise ValueError(f"target_verify: {tokens} tokens are not whole groups of cache_steps={D} draft tokens")
    B = tokens // D
    if intermediate_states_buffer.dim() != 5 or tuple(intermediate_states_buffer.shape[2:]) != (HV, V, K) \
            or intermediate_states_buffer.shape[1] < D:
        raise ValueError(f"intermediate_states_buffer must be [S, >= {D}, {HV}, {V}, {K}], got "
                         f"{tuple(intermediate_states_buffer.shape)}")
    if retrieve_parent_token is not None and tuple(retrieve_parent_token.shape) != (B, D):
        raise ValueError(f"retrieve_parent_token must be [{B}, {D}], got {tuple(retrieve_parent_token.shape)}")
    qd, kd = q.reshape(B, D, H, K), k.reshape(B, D, H, K)
    vd = v.reshape(B, D, HV, V)
    gd = a.reshape(B, D, HV, K)
    bd = b.reshape(B, D, HV)
    rows = intermediate_state_indices[:B].to(torch.int64)
    root = ssm_states.index_select(0, cache_indices[:B].to(torch.int64))  # [B, HV, V, K]
    states = torch.empty(B, D, HV, V, K, dtype=torch.float32, device=q.device)
    out = torch.empty(B, D, HV, V, dtype=v.dtype, device=q.device)
    arange = torch.arange(B, device=q.device)
    for t in range(D):
        if t == 0:
            start = root
        else:
            parent = (torch.full((B,), t - 1, device=q.device, dtype=torch.int64) if retrieve_parent_token is None
                      else retrieve_parent_token[:, t].to(torch.int64))
            start = torch.where((parent < 0).view(B, 1, 1, 1), root, states[arange, parent.clamp(min=0)])
        o_t, s_t = fused_recurrent_kda(
            qd[:, t:t + 1], kd[:, t:t + 1], vd[:, t:t + 1], gd[:, t:t + 1], bd[:, t:t + 1], A_log=A_log,
            dt_bias=dt_bias, initial_state=start.contiguous(), output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            lower_bound=lower_bound, state_v_first=True)
        out[:, t] = o_t[:, 0]
        states[:, t] = s_t
    intermediate_states_buffer[rows, :D] = states.to(intermediate_states_buffer.dtype)
    return out.reshape(1, tokens, HV, V)
