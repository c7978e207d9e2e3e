"""Plain-torch KDA references (the spec for the Triton kernels). FLA's layouts and conventions:
q, k [B, T, H, K]; v [B, T, HV, V]; g log-decay [B, T, HV, K]; beta [B, T, HV] in (0, 1);
state [B, HV, K, V] fp32; q is scaled by `scale` (default K^-1/2); output in v.dtype.
Recurrence (decay, then delta rule): S' = diag(exp g_t) S; S = S' + beta_t k_t (v_t - S'^T k_t)^T; o_t = S^T q_t.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from k3_kernels.elementwise import position_invariant


# In-chunk cumulative log-decays down to -_FACTOR_SPAN keep exp(-G) below e^80 (fp32 max ~ e^88): the chunked
# reference then factorises the decay (K3's safe gate, >= -5 per token, with 16-token chunks always does).
_FACTOR_SPAN = 80.0


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (FLA's l2norm), computed in fp32. The sum runs over contiguous
    rows: a CPU reduction over a strided last dim (the short conv's transposed output) sums a row differently
    depending on how many rows share the call, a contiguous one does not."""
    xf = x.float().contiguous()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def naive_kda_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Default KDA gate: -exp(A_log[h]) * softplus(g + dt_bias). g [..., H, K]; A_log [H]; dt_bias [H*K]."""
    H, K = g.shape[-2:]
    x = g.float()
    if dt_bias is not None:
        x = x + dt_bias.float().view(H, K)
    return -A_log.float().view(H, 1).exp() * F.softplus(x)


def naive_kda_lowerbound_gate(g: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
                              lower_bound: float) -> torch.Tensor:
    """K3's safe gate: lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias)), in (lower_bound, 0)."""
    H, K = g.shape[-2:]
    x = g.float()
    if dt_bias is not None:
        x = x + dt_bias.float().view(H, K)
    if A_log is not None:
        x = A_log.float().view(H, 1).exp() * x
    return lower_bound * torch.sigmoid(x)


def naive_kda_step_inputs(xq: torch.Tensor | None, xk: torch.Tensor, xv: torch.Tensor, f: torch.Tensor,
                          b: torch.Tensor, windows: torch.Tensor | None, conv_weights: tuple[torch.Tensor, ...],
                          A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None,
                          eps: float = 1e-6, with_q: bool = True, roll: torch.Tensor | None = None):
    """KDA's per-token inputs from its projections (the spec of `step_inputs.fused_kda_step_inputs`):
    q, k = L2Norm(SiLU(ShortConv(x))), v = SiLU(ShortConv(xv)), g the gate (K3's safe gate when `lower_bound` is
    set, else KDA's default), beta = sigmoid(b). xq, xk, xv, f [B, T, H*K]; b [B, T, H]; windows [B, 3, H*K, W-1]
    (the q / k / v short-conv windows; None: zeros); conv_weights the three depthwise weights [H*K, 1, W].
    Returns (q [B, T, H, K] or None without `with_q` (its window is still rolled), k, v in x's dtype, g [B, T, H, K]
    fp32, beta [B, T, H] fp32, new windows [B, 3, H*K, W-1] in x's dtype: the last W-1 positions of [window | x],
    or with `roll` [B] of [window | x[b, :roll[b]]], a speculative commit's accepted tokens). The short conv is
    F.conv1d over [window | x] (on CPU each token's sum is the same whatever T is:
    tests/model/test_verify_shapes.py)."""
    B, T, C = xk.shape
    H = b.shape[-1]
    K = C // H
    W1 = conv_weights[0].shape[-1] - 1

    def full_window(x: torch.Tensor, s: int) -> torch.Tensor:   # [window | x] as [B, C, W-1+T] in x's dtype
        w = x.new_zeros(B, C, W1) if windows is None else windows[:, s].to(x.dtype)
        return torch.cat([w, x.transpose(1, 2)], dim=-1)

    def rolled(full: torch.Tensor) -> torch.Tensor:   # the window after T (or roll[b]) tokens
        if roll is None:
            return full[..., full.shape[-1] - W1:]
        cols = roll.to(device=full.device, dtype=torch.long).view(B, 1, 1) + torch.arange(W1, device=full.device)
        return torch.gather(full, -1, cols.expand(B, C, W1))

    def conv_silu(x: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        full = full_window(x, s)
        y = F.silu(F.conv1d(full, conv_weights[s], groups=C))
        return y.transpose(1, 2), rolled(full)

    if roll is not None and tuple(roll.shape) != (B,):
        raise ValueError(f"KDA step inputs: roll {tuple(roll.shape)} must be [B={B}]")
    if with_q:
        q, wq = conv_silu(xq, 0)
        q = l2norm(q.reshape(B, T, H, K), eps)
    else:
        q, wq = None, rolled(full_window(xq, 0))
    k, wk = conv_silu(xk, 1)
    v, wv = conv_silu(xv, 2)
    k = l2norm(k.reshape(B, T, H, K), eps)
    v = v.reshape(B, T, H, K)
    f = f.reshape(B, T, H, K)
    g = (naive_kda_lowerbound_gate(f, A_log, dt_bias, lower_bound) if lower_bound is not None
         else naive_kda_gate(f, A_log, dt_bias))
    beta = position_invariant(torch.sigmoid, b.float())   # [B, T, H]: few values per token (CPU tails)
    return q, k, v, g, beta, torch.stack([wq, wk, wv], dim=1)


def _expand_heads(q: torch.Tensor, k: torch.Tensor, hv: int) -> tuple[torch.Tensor, torch.Tensor]:
    rep = hv // q.shape[2]
    if rep * q.shape[2] != hv:
        raise ValueError(f"v heads ({hv}) must be a multiple of q/k heads ({q.shape[2]})")
    return q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)


def naive_recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        scale: float | None = None, initial_state: torch.Tensor | None = None,
                        output_final_state: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA; returns (o [B, T, HV, V], final state [B, HV, K, V] fp32 or None)."""
    out_dtype = v.dtype
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K ** -0.5 if scale is None else scale
    acc = torch.promote_types(v.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    q, k = _expand_heads(q.to(acc), k.to(acc), HV)
    q = q * scale
    v, g, beta = v.to(acc), g.to(acc), beta.to(acc)
    S = q.new_zeros(B, HV, K, V)
    if initial_state is not None:
        S = S + initial_state.to(acc)
    o = v.new_zeros(B, T, HV, V)
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        u = v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S)
        S = S + torch.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * k[:, t], u)
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], S)
    return o.to(out_dtype), (S if output_final_state else None)


def naive_chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    scale: float | None = None, initial_state: torch.Tensor | None = None,
                    output_final_state: bool = False, chunk_size: int = 64
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked (WY/UT) KDA for any T: same math as `naive_recurrent_kda`, chunk-parallel within each chunk.

    Per chunk with in-chunk cumulative gate G: A[i,j] = beta_i <k_i exp(G_i - G_j), k_j> (i > j),
    T = (I + A)^-1 diag(beta), W = T (exp(G) k), U = T v, v' = U - W S,
    o = (q exp(G)) S + tril(<q_i exp(G_i - G_j), k_j>) v', S <- exp(G_C) S + (exp(G_C - G) k)^T v'.
    Decays are formed as exp(G_i) exp(-G_j) when the in-chunk span allows it, else as exp of non-positive
    differences (no overflow at any span).
    """
    out_dtype = v.dtype
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    C = chunk_size
    scale = K ** -0.5 if scale is None else scale
    acc = torch.promote_types(v.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    q, k = _expand_heads(q.to(acc), k.to(acc), HV)
    q = q * scale
    v, g, beta = v.to(acc), g.to(acc), beta.to(acc)
    pad = (-T) % C
    if pad:  # zero k, v, beta, g leave the state untouched; padded outputs are dropped
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    N = (T + pad) // C
    # [B, HV, N, C, D]
    q, k, v, g = (x.view(B, N, C, HV, -1).permute(0, 3, 1, 2, 4) for x in (q, k, v, g))
    beta = beta.view(B, N, C, HV).permute(0, 3, 1, 2)
    G = g.cumsum(-2)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    if G.numel() == 0 or float(G.detach().min()) >= -_FACTOR_SPAN:
        # exp(G_i - G_j) = exp(G_i) exp(-G_j) with both factors inside the float range: two matmuls
        A_kk = (k * G.exp()) @ (k * (-G).exp()).transpose(-1, -2)
        A_qk = ((q * G.exp()) @ (k * (-G).exp()).transpose(-1, -2)).masked_fill(~causal, 0.0)
    else:  # pairwise differences G_i - G_j <= 0: never overflows, O(C^2 K) memory
        diff = G[..., :, None, :] - G[..., None, :, :]          # [B, HV, N, C(i), C(j), K]
        decay = torch.where(causal[..., None], diff, torch.full_like(diff, float("-inf"))).exp()
        A_kk = torch.einsum("bhnik,bhnijk,bhnjk->bhnij", k, decay, k)
        A_qk = torch.einsum("bhnik,bhnijk,bhnjk->bhnij", q, decay, k)
    A_kk = (A_kk * beta[..., None]).masked_fill(~causal.tril(-1), 0.0)
    eye = torch.eye(C, device=q.device, dtype=acc)
    L = eye + A_kk
    Tm = torch.linalg.solve_triangular(L, torch.diag_embed(beta), upper=False, unitriangular=True)
    W = Tm @ (G.exp() * k)
    U = Tm @ v
    S = q.new_zeros(B, HV, K, V)
    if initial_state is not None:
        S = S + initial_state.to(acc)
    o = torch.empty_like(v)
    G_last = G[..., -1:, :]                                      # [B, HV, N, 1, K]
    k_to_end = (G_last - G).exp() * k
    q_decayed = q * G.exp()
    for n in range(N):
        v_new = U[:, :, n] - W[:, :, n] @ S
        o[:, :, n] = q_decayed[:, :, n] @ S + A_qk[:, :, n] @ v_new
        S = S * G_last[:, :, n, 0, :, None].exp() + k_to_end[:, :, n].transpose(-1, -2) @ v_new
    o = o.permute(0, 2, 3, 1, 4).reshape(B, N * C, HV, V)[:, :T]
    return o.to(out_dtype), (S if output_final_state else None)
