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
                        beta: torch.Tensor, n_accept: torch.Tensor, n_accept_checked: bool = False) -> None:
    """Shapes and ranges, checked before any work (the message names the offending tensor). `n_accept_checked`:
    the caller built n_accept from host values it checked (the engine's commit), so its range is not read back
    from the device (a sync, and not allowed inside a CUDA graph capture)."""
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
    if B and not n_accept_checked and (int(n_accept.min()) < 0 or int(n_accept.max()) > T):
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


def check_state_rows(store: torch.Tensor, rows: torch.Tensor, n_accept: torch.Tensor, checked: bool = False) -> None:
    """`replay_commit_into`'s store and row indices (the message names the offending tensor). `checked`: the caller
    built rows and n_accept from host values it checked (in range, rows distinct wherever n_accept > 0): nothing
    is read back from the device (a sync, not allowed inside a CUDA graph capture)."""
    if store.dim() != 4 or store.dtype != torch.float32:
        raise ValueError(f"store: expected fp32 [N, HV, K, V], got {store.dtype} {tuple(store.shape)}")
    if rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64) or rows.shape != n_accept.shape:
        raise ValueError(f"rows: expected int [B={n_accept.shape[0] if n_accept.dim() else '?'}] (as n_accept), "
                         f"got {rows.dtype} {tuple(rows.shape)}")
    if checked or not rows.numel():
        return
    live = rows[n_accept > 0]
    if int(rows.min()) < 0 or int(rows.max()) >= store.shape[0]:
        raise ValueError(f"rows: values must be in [0, {store.shape[0]}), got range [{int(rows.min())}, "
                         f"{int(rows.max())}]")
    if live.unique().numel() != live.numel():
        raise ValueError("rows: a state row appears twice among the rows that accept tokens")


def naive_replay_commit_into(store: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             g: torch.Tensor, beta: torch.Tensor, n_accept: torch.Tensor) -> None:
    """`naive_replay_commit` of the states store[rows[b]] (a pool's rows, [N, HV, K, V] fp32), written back in
    place: the engine's commit without gathering the states out of the pool and scattering them back. Rows with
    n_accept[b] = 0 are not written (idle seats may share one spare row)."""
    check_state_rows(store, rows, n_accept)
    new = naive_replay_commit(store[rows.long()], k, v, g, beta, n_accept)
    keep = n_accept.to(new.device) > 0
    store[rows.long()[keep]] = new[keep]


# ---------------------------------------------------------------------------------------------- token trees
def check_tree_inputs(state: torch.Tensor, q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor,
                      g: torch.Tensor, beta: torch.Tensor, parents: torch.Tensor,
                      accept_node: torch.Tensor | None) -> None:
    """Shapes and the tree's structure, checked before any work (the message names the offending tensor)."""
    check_replay_inputs(state, k, v, g, beta, torch.zeros(k.shape[1], dtype=torch.long))
    N, B = k.shape[:2]
    if q is not None and tuple(q.shape) != tuple(k.shape):
        raise ValueError(f"q: expected {tuple(k.shape)} (as k), got {tuple(q.shape)}")
    if tuple(parents.shape) != (B, N) or parents.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"parents: expected int [B={B}, N={N}], got {parents.dtype} {tuple(parents.shape)}")
    if parents.is_cuda and torch.cuda.is_current_stream_capturing():
        return   # a captured graph's static buffers: their values are checked where the host packs them
    par = parents.cpu()
    node = torch.arange(N).view(1, N)
    if B and N and (bool((par < -1).any()) or bool((par >= node).any())):
        raise ValueError("parents: node n's parent must be -1 (the committed state) or an earlier node < n")
    if accept_node is not None:
        if tuple(accept_node.shape) != (B,) or accept_node.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"accept_node: expected int [B={B}], got {accept_node.dtype} {tuple(accept_node.shape)}")
        a = accept_node.cpu()
        if B and (int(a.min()) < -1 or int(a.max()) >= N):
            raise ValueError(f"accept_node: values must be in [-1, {N - 1}] (-1: nothing accepted), got range "
                             f"[{int(a.min())}, {int(a.max())}]")


def tree_paths(parents: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """parents [B, N] -> (paths [B, N, D] int32: node n's path from the root's child down to n itself, padded with
    0; depths [B, N] int32: its length). D = `width` (a fixed shape, e.g. N for a captured graph's buffers; at least
    the deepest path) or the deepest path (>= 1)."""
    par = parents.cpu().tolist()
    B, N = len(par), (len(par[0]) if par else 0)
    rows = []
    for b in range(B):
        rows.append([])
        for n in range(N):
            path, m = [], n
            while m >= 0:
                path.append(m)
                m = par[b][m]
            rows[b].append(path[::-1])
    D = max([len(p) for r in rows for p in r], default=1)
    if width is not None:
        if width < D:
            raise ValueError(f"width: {width} cannot hold the deepest path ({D} nodes)")
        D = width
    paths = torch.zeros(B, N, D, dtype=torch.int32)
    depths = torch.zeros(B, N, dtype=torch.int32)
    for b in range(B):
        for n, p in enumerate(rows[b]):
            paths[b, n, :len(p)] = torch.tensor(p, dtype=torch.int32)
            depths[b, n] = len(p)
    return paths, depths


def naive_tree_verify(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, parents: torch.Tensor, accept_node: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA over a token tree, the spec for `tree.py`: node n's output is the decode step of its inputs from its
    parent's state (the committed `state` for parent -1), i.e. what plain decoding outputs at n if n's path is the
    sequence. Node-major inputs: q, k [N, B, H, K]; v [N, B, HV, V]; g [N, B, HV, K]; beta [N, B, HV]; parents
    [B, N] int (parent < node). Returns (o [N, B, HV, V] in v's dtype, and with `accept_node` [B] (-1: none) the
    state after each row's accepted node: the ReplaySSM commit of its path, else None).

    The reference keeps every node's state (it is the spec, not the memory plan); each node is one
    `naive_recurrent_kda` single-token step on all B rows, as decode runs."""
    check_tree_inputs(state, q, k, v, g, beta, parents, accept_node)
    N, B = k.shape[:2]
    par = parents.to(torch.long).to(state.device)
    rows = torch.arange(B, device=state.device)
    states = [state]   # states[n + 1]: after node n
    outs = []
    for n in range(N):
        S_par = torch.stack(states)[par[:, n] + 1, rows]
        o, S = naive_recurrent_kda(q[n].unsqueeze(1), k[n].unsqueeze(1), v[n].unsqueeze(1), g[n].unsqueeze(1),
                                   beta[n].unsqueeze(1), initial_state=S_par, output_final_state=True)
        outs.append(o[:, 0])
        states.append(S)
    o = torch.stack(outs) if outs else v.new_zeros(v.shape)
    if accept_node is None:
        return o, None
    return o, torch.stack(states)[accept_node.to(torch.long).to(state.device) + 1, rows].clone()


def path_inputs(x: torch.Tensor, parents: torch.Tensor, accept_node: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A tree's node-major inputs x [N, B, ...] along each row's accepted path, root first -> ([D, B, ...] padded
    with zeros, n_accept [B]): what `naive_replay_commit` / `replay_commit` fold (the chain commit of the path)."""
    paths, depths = tree_paths(parents)
    acc = accept_node.cpu().to(torch.long)
    B = x.shape[1]
    D = paths.shape[2]
    out = x.new_zeros(D, *x.shape[1:])
    n = torch.zeros(B, dtype=torch.long)
    for b in range(B):
        if int(acc[b]) >= 0:
            p = paths[b, int(acc[b]), :int(depths[b, int(acc[b])])].to(torch.long)
            out[:len(p), b] = x[p.to(x.device), b]
            n[b] = len(p)
    return out, n.to(x.device)
