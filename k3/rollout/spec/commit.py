"""The commit of a speculative step (ReplaySSM): keep each row's accepted verify positions. Every KDA layer folds the
accepted prefix's stored step inputs into the committed state (k3.model.ops.kda_replay_commit, at the decode batch
size, as decode runs) and rolls the short-conv window forward by the same tokens; MLA pages past the committed
length (rejected positions) go back to the pool. Only committed states ever reach the state pool."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from k3.model import ops
from k3.rollout.spec.scratch import ReplayScratch

if TYPE_CHECKING:
    from k3.rollout.engine import Engine
    from k3.rollout.sequence import RunningSeq


def replay_step_inputs(mod, scratch: ReplayScratch, ki: int, window: torch.Tensor, steps: int, n_seat: torch.Tensor,
                       B: int) -> tuple[torch.Tensor, ...]:
    """k, v, g, beta [steps, B, ...] of the stored positions of KDA layer `ki` (module `mod`), rebuilt from the
    stored projections by the layer's own `step_inputs`, one position at a time at the decode batch size from the
    committed windows `window` [B, 3, C, W-1] (each seat's window moves on only while it accepts): the bits the
    verify pass computed, and plain decoding would; then the windows [B, 3, C, W-1] rolled by each seat's accepted
    count `n_seat`. With the fused kernel (CUDA) one call over all positions gives the same bits
    (tests/kernels/test_kda_step_inputs.py, tests/rollout/test_spec_engine.py) and rolls the windows itself;
    positions past a seat's accepted count are computed and not folded."""
    if ops.kda_step_kernel(window):   # invariant to the tokens per call: all positions at once
        x, f, b = (scratch.by_seat(ki, name, B)[:, :steps] for name in ("conv_in", "f", "b"))   # [B, steps, ...]
        _, k, v, g, beta, rolled = mod.step_inputs(x[:, :, 0], x[:, :, 1], x[:, :, 2], f, b, window, with_q=False,
                                                   roll=n_seat)
        return tuple(t.transpose(0, 1) for t in (k, v, g, beta)) + (rolled,)
    proj = {name: scratch.seats(ki, name, list(range(scratch.rows)), B) for name in ("conv_in", "f", "b")}
    ks, vs, gs, bs = [], [], [], []
    for t in range(steps):
        x = proj["conv_in"][t]
        _, k, v, g, beta, nxt = mod.step_inputs(x[:, None, 0], x[:, None, 1], x[:, None, 2], proj["f"][t, :, None],
                                                proj["b"][t, :, None], window, with_q=False)
        keep = (n_seat > t).view(-1, 1, 1, 1)
        window = torch.where(keep, nxt.to(window.dtype), window)
        ks.append(k[:, 0])
        vs.append(v[:, 0])
        gs.append(g[:, 0])
        bs.append(beta[:, 0])
    return tuple(torch.stack(x) for x in (ks, vs, gs, bs)) + (window,)


def commit(eng: "Engine", rows: list["RunningSeq"], scratch: ReplayScratch, n_commit: list[int],
           fold_layers: bool | None = None) -> None:
    """Keep the first n_commit[r] verify positions of row r (its accepted path): ReplaySSM fold of every KDA layer's
    rebuilt step inputs from the committed state, conv windows rolled forward, MLA pages past the new length
    released. The step inputs are rebuilt layer by layer at the decode batch size, rows in the seats they verified
    in (as decode computes them). CPU folds each layer at that batch size too (decode's own step, bit for bit);
    with `fold_layers` (default: on CUDA) the layers' folds, conv rolls, state gathers and writes run together
    (`_fold_layers_together`), a handful of launches per group of layers instead of per layer. After a captured
    verify (k3.rollout.graphs) that fold over every seat is a captured graph too."""
    if eng.graphs is not None and eng.graphs.commit(rows, scratch, n_commit):
        _release_rejected_pages(eng, rows, n_commit)   # the captured commit wrote the states
        return
    B, R = eng.cfg.decode_batch, len(rows)
    dev = eng.device
    slots = torch.tensor([eng.states.slot(s.state) for s in rows], dtype=torch.long, device=dev)
    n_seat = torch.zeros(B, dtype=torch.long, device=dev)
    n_seat[:R] = torch.tensor(n_commit, dtype=torch.long)
    steps = max(n_commit)
    rec_store, conv_store = eng.states.dev["rec"], eng.states.dev["conv"]
    if fold_layers if fold_layers is not None else dev.type == "cuda":
        fold_and_write(eng, scratch, slots, n_seat, steps, R)
        _release_rejected_pages(eng, rows, n_commit)
        return
    layer_of = {ki: layer for layer, ki in eng.kda_index.items()}
    recs, convs = [], []
    for ki in range(len(eng.kda_index)):   # computed in full before anything is written
        S0 = rec_store.new_zeros(B, *rec_store.shape[2:])
        S0[:R] = rec_store[slots, ki]
        window = conv_store.new_zeros(B, *conv_store.shape[2:])
        window[:R] = conv_store[slots, ki]
        mod = eng.model.model.layers[layer_of[ki]].self_attn
        k, v, g, beta, rolled = replay_step_inputs(mod, scratch, ki, window, steps, n_seat, B)
        recs.append(ops.kda_replay_commit(S0, k, v, g, beta, n_seat)[:R])
        convs.append(rolled[:R])
    rec, conv = torch.stack(recs, 1), torch.stack(convs, 1)
    rec_store[slots] = rec.to(torch.float32)
    conv_store[slots] = conv.to(conv_store.dtype)
    _release_rejected_pages(eng, rows, n_commit)


def _release_rejected_pages(eng: "Engine", rows: list["RunningSeq"], n_commit: list[int]) -> None:
    """MLA pages past each row's new length (rejected positions) go back to the pool."""
    P = eng.cfg.page_size
    for s, n in zip(rows, n_commit):
        keep = math.ceil((s.pos + n) / P)
        for p in s.bt[keep:]:
            eng.pages.unpin(p)
            eng.pages.decref(p)
        del s.bt[keep:]


LAYERS_PER_FOLD = 16   # bounds the gathered states: R x 16 x 6.3 MB at K3's dims


def fold_and_write(eng: "Engine", scratch: ReplayScratch, slots: torch.Tensor, n_seat: torch.Tensor, steps: int,
                   R: int) -> None:
    """`_fold_layers_together` for the rows in the first R seats (state slots `slots` [R], accepted counts
    `n_seat` [decode_batch]): the new states folded in place in the pool, then the windows written to their slots.
    No host sync: the engine's captured commit (k3.rollout.graphs) is this call over every seat (idle seats on the
    spare slot, nothing accepted: nothing written there)."""
    conv = _fold_layers_together(eng, scratch, slots, n_seat, steps, R)
    conv_store = eng.states.dev["conv"]
    conv_store[slots] = conv.to(conv_store.dtype)


def _fold_layers_together(eng: "Engine", scratch: ReplayScratch, slots: torch.Tensor, n_seat: torch.Tensor,
                          steps: int, R: int) -> torch.Tensor:
    """The commit's folds with the layers side by side: up to LAYERS_PER_FOLD layers' states of the R rows in one
    replay call ([R x layers] rows: the Triton fold runs one program per row, head and value block, so a row's bits
    do not depend on the rows beside it), folded in place in the state pool (`ops.kda_replay_commit_into`: read
    and written once, not gathered and scattered), the committed windows gathered once. The step inputs are still
    rebuilt per layer at the decode batch size (each layer's own weights) from the committed windows, gathered
    before any state is written; that call rolls the windows by each seat's accepted count too. Returns the new
    windows [R, L, 3, C, W-1]."""
    B = eng.cfg.decode_batch
    rec_store, conv_store = eng.states.dev["rec"], eng.states.dev["conv"]
    layer_of = {ki: layer for layer, ki in eng.kda_index.items()}
    L = len(eng.kda_index)
    windows = conv_store.new_zeros(B, L, *conv_store.shape[2:])
    windows[:R] = conv_store[slots]
    n_rows = n_seat[:R]
    state_rows = rec_store.view(-1, *rec_store.shape[2:])   # [slots x L, HV, K, V]: slot s, layer l at s * L + l
    convs = []
    for l0 in range(0, L, LAYERS_PER_FOLD):
        group = range(l0, min(L, l0 + LAYERS_PER_FOLD))
        n = len(group)
        inputs, rolled = [], []
        for ki in group:
            mod = eng.model.model.layers[layer_of[ki]].self_attn
            k, v, g, beta, window = replay_step_inputs(mod, scratch, ki, windows[:, ki], steps, n_seat, B)
            inputs.append((k[:, :R], v[:, :R], g[:, :R], beta[:, :R]))
            rolled.append(window[:R])
        # row r * n + j: request r, layer l0 + j (position-major inputs [steps, R * n, ...])
        k, v, g, beta = (torch.stack(xs, 2).flatten(1, 2) for xs in zip(*inputs))
        n_accept = n_rows.repeat_interleave(n)
        rows = (slots.view(R, 1) * L + torch.arange(l0, l0 + n, device=slots.device)).flatten()
        # (slots and n_commit are built on the host: distinct live slots, counts within [0, steps])
        ops.kda_replay_commit_into(state_rows, rows, k, v, g, beta, n_accept, checked=True)
        convs += rolled
    return torch.stack(convs, 1)
