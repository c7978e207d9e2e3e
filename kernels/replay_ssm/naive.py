"""ReplaySSM commit for KDA, plain torch (the spec for `replay.py`).

Speculative verification stores, per draft position, only the step inputs of each KDA layer (post-conv, post-L2Norm
k, v, the log-decay g, beta, and the pre-conv q/k/v inputs of the short conv); it never writes a recurrent state
per draft. Once the target has accepted a prefix of the draft, the commit folds that prefix's stored inputs into
the committed state, starting from the committed checkpoint, and rolls the short-conv window forward by the same
tokens. Row b folds its first `n_accept[b]` positions; rows with 0 keep their state unchanged.

The spec of the fold is the decode step itself: position t is folded by `naive_recurrent_kda` on a single token
(T = 1), so the committed state is bitwise the state plain token-by-token decoding reaches (same ops, same order,
same shapes). Position-major layout: inputs are [T, B, ...] so that each step reads a contiguous [B, ...] slice.
"""
from __future__ import annotations

import torch

from k3_kernels.kda.naive import naive_recurrent_kda


def check_replay_inputs(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, n_accept: torch.Tensor) -> None:
    """Shapes and ranges, checked before any work (the message names the offending tensor)."""
    if state.dim() != 4 or state.dtype != torch.float32:
        raise ValueError(f"state: expected fp32 [B, HV, K, V], got {state.dtype} {tuple(state.shape)}")
    B, HV, K, V = state.shape
    if k.dim() != 4 or k.shape[1] != B or k.shape[3] != K:
        raise ValueError(f"k: expected [T, B={B}, H, K={K}], got {tuple(k.shape)}")
    T, H = k.shape[0], k.shape[2]
    if HV % H:
        raise ValueError(f"k: {H} heads do not divide the state's {HV} value heads")
    for name, x, want in (("v", v, (T, B, HV, V)), ("g", g, (T, B, HV, K)), ("beta", beta, (T, B, HV))):
        if tuple(x.shape) != want:
            raise ValueError(f"{name}: expected {want}, got {tuple(x.shape)}")
    if tuple(n_accept.shape) != (B,) or n_accept.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"n_accept: expected int [B={B}], got {n_accept.dtype} {tuple(n_accept.shape)}")
    if B and (int(n_accept.min()) < 0 or int(n_accept.max()) > T):
        raise ValueError(f"n_accept: values must be in [0, {T}], got range "
                         f"[{int(n_accept.min())}, {int(n_accept.max())}]")


def naive_replay_commit(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, n_accept: torch.Tensor) -> torch.Tensor:
    """Fold the accepted prefix into the committed state.

    state [B, HV, K, V] fp32 (the committed checkpoint, not modified); k [T, B, H, K]; v [T, B, HV, V];
    g [T, B, HV, K] (log-decay); beta [T, B, HV]; n_accept [B] int in [0, T]. Returns the new state [B, HV, K, V].
    Every step runs on all B rows (as decode does, at the same batch size) and is kept only for rows that accept it.
    """
    check_replay_inputs(state, k, v, g, beta, n_accept)
    T = k.shape[0]
    steps = int(n_accept.max()) if n_accept.numel() else 0
    S = state
    q0 = torch.zeros_like(k[0]).unsqueeze(1)
    for t in range(min(steps, T)):
        _, S_t = naive_recurrent_kda(q0, k[t].unsqueeze(1), v[t].unsqueeze(1), g[t].unsqueeze(1),
                                     beta[t].unsqueeze(1), initial_state=S, output_final_state=True)
        keep = (n_accept > t).to(S.device).view(-1, 1, 1, 1)
        S = torch.where(keep, S_t, S)
    return S if steps else state.clone()


def naive_conv_roll(window: torch.Tensor, inputs: torch.Tensor, n_accept: torch.Tensor) -> torch.Tensor:
    """Roll the short-conv windows forward by each row's accepted tokens.

    window [B, ..., W-1] (the committed pre-conv inputs of the last W-1 tokens, oldest first); inputs [T, B, ...]
    (each draft position's pre-conv input); n_accept [B]. Returns the windows after the first n_accept[b] inputs:
    the last W-1 columns of [window | inputs[:n_accept[b]]] (pure data movement: exact)."""
    T, B = inputs.shape[:2]
    if tuple(window.shape[:-1]) != tuple(inputs.shape[1:]):
        raise ValueError(f"window: expected [B, ..., W-1] matching inputs [T, B, ...] = {tuple(inputs.shape)}, "
                         f"got {tuple(window.shape)}")
    if tuple(n_accept.shape) != (B,):
        raise ValueError(f"n_accept: expected [B={B}], got {tuple(n_accept.shape)}")
    w = window.shape[-1]
    full = torch.cat([window, inputs.to(window.dtype).movedim(0, -1)], dim=-1)   # [B, ..., W-1+T]
    start = n_accept.to(torch.long).to(full.device).view(B, *([1] * (full.dim() - 1)))
    cols = start + torch.arange(w, device=full.device)
    return torch.gather(full, -1, cols.expand(*full.shape[:-1], w))
