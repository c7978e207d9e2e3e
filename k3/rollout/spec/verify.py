"""The verify pass: the target scores the pending token and the draft (a chain or a token tree) of every row of one
decode group, writing the MLA latents of the verified positions into the rows' pages and, for KDA, only the step
inputs (ReplayScratch) -- the state pool is never written here. `commit.commit` keeps the accepted path.

EXACT mode (`verify_walk`) runs each verify position with decode's shapes ([decode_batch, 1]) and walks the
acceptance down the tree as it goes; the KDA layers continue from a working state that lives only in this pass
(one per seat, overwritten position by position, as decode's own activations are). BATCHED mode
(`verify_batched`) runs one [decode_batch, T] forward of chain drafts from the committed states.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from k3_kernels.replay_ssm.naive import tree_paths
from k3.rollout.sampler import NextLogits, next_logits
from k3.rollout.spec.scratch import ReplayScratch
from k3.rollout.view import PoolView

if TYPE_CHECKING:
    from k3.rollout.engine import Engine
    from k3.rollout.sequence import RunningSeq


class SpecView(PoolView):
    """PoolView for verify positions [t0, t0+T): MLA as usual (the rows' `pos` is set to pos0 + t0 by the caller);
    KDA reads the committed state (t0 == 0) or this pass's working state, records the step inputs into the
    scratch and never writes the pool."""

    def __init__(self, eng: "Engine", rows: list["RunningSeq | None"], T: int, t0: int, scratch: ReplayScratch,
                 row_of_seat: list[int | None], working: dict[int, tuple[torch.Tensor, torch.Tensor]]):
        super().__init__(eng, rows, T)
        self.t0, self.scratch, self.working = t0, scratch, working
        self.rec_seats = [b for b, r in enumerate(rows) if r is not None]
        self.rec_rows = [row_of_seat[b] for b in self.rec_seats]

    def kda(self, layer):
        if self.t0 == 0:
            return super().kda(layer)
        rec, conv = self.working[layer]
        empty = [b for b, r in enumerate(self.rows) if r is None]
        if empty:   # seats without a row this position start fresh, as decode's dummy seats do
            rec, conv = rec.clone(), conv.clone()
            rec[empty] = 0
            conv[empty] = 0
        return rec, conv

    def set_kda(self, layer, recurrent, conv):
        self.working[layer] = (recurrent, conv)

    def record_kda_inputs(self, layer, conv_in, f, b):
        s = self.rec_seats
        self.scratch.store(self.eng.kda_index[layer], self.rec_rows, self.t0, conv_in[s], f[s], b[s])


def tree_tensors(parents: list[list[int]], T: int, W1: int) -> tuple[torch.Tensor, ...]:
    """A batched tree verify's layout from each seat's parent positions `parents[b]` (T each; -1: the committed
    state) -> (parents [B, T] int64, ancestors [B, T, T] bool: position i sees j iff j is i or an ancestor,
    window columns [B, T, W1] int64: the short-conv window of position i as columns of [committed window | the
    call's inputs] -- the committed window, then its ancestors' inputs, the last W1; the KDA tree kernel's paths
    [B, T, T] and depths [B, T] (k3_kernels.replay_ssm.tree_paths at width T))."""
    B = len(parents)
    for b, par in enumerate(parents):
        if len(par) != T or any(not -1 <= p < i for i, p in enumerate(par)):
            raise ValueError(f"parents[{b}]: expected {T} positions, each -1 (the committed state) or an earlier "
                             f"position, got {list(par)}")
    anc = torch.zeros(B, T, T, dtype=torch.bool)
    cols = torch.zeros(B, T, W1, dtype=torch.long)
    for b, par in enumerate(parents):
        for i in range(T):
            path, j = [], i
            while j >= 0:
                anc[b, i, j] = True
                path.append(j)
                j = par[j]
            c = list(range(W1)) + [W1 + a for a in reversed(path[1:])]   # committed window, then ancestors
            cols[b, i] = torch.tensor(c[len(c) - W1:], dtype=torch.long)
    par = torch.tensor(parents, dtype=torch.long).view(B, T)
    return (par, anc, cols) + tree_paths(par, width=max(T, 1))


class TreeOps:
    """The token-tree parts of a batched verify view, over its `tree_parents` [B, T], `anc` [B, T, T] bool,
    `window_cols` [B, T, W-1] and `past` [B] (host tensors: TreeSpecView; static device buffers:
    k3.rollout.graphs.StaticTreeView). MLA: each position sees the row's prefix and its ancestors
    (`attention_mask`); KDA (`kda_tree`): each node's short conv over the window along its own path and its
    recurrence from its parent's state (k3_kernels.replay_ssm tree verify: inputs only, no state per node); the
    pool is not written."""

    def attention_mask(self, S: int) -> torch.Tensor:
        anc = self.anc
        B, T = anc.shape[:2]
        s = torch.arange(S, device=anc.device).view(1, 1, S)
        past = self.past.to(anc.device).view(B, 1, 1)
        rel = (s - past).clamp(0, T - 1).expand(B, T, S)
        return (s < past) | ((s >= past) & (s < past + T) & torch.gather(anc, 2, rel))

    def step_inputs(self, mod, xq, xk, xv, f, b, conv):
        B, T, C = xq.shape
        W1 = mod.conv_size - 1
        if conv is None:
            conv = xq.new_zeros(B, 3, C, W1)
        src = torch.cat([conv.to(xq.dtype), torch.stack([xq, xk, xv], dim=1).transpose(2, 3)], dim=-1)
        cols = self.window_cols.to(src.device)   # [B, T, W-1]
        idx = cols.reshape(B, 1, 1, T * W1).expand(B, 3, C, T * W1)
        windows = torch.gather(src, 3, idx).view(B, 3, C, T, W1).permute(0, 3, 1, 2, 4).reshape(B * T, 3, C, W1)
        one = lambda x: x.reshape(B * T, 1, x.shape[-1])   # noqa: E731 (every node a one-token row)
        q, k, v, g, beta, _ = mod.step_inputs(one(xq), one(xk), one(xv), one(f), one(b), windows)
        H, K = q.shape[2:]
        return (q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, H, K), g.view(B, T, H, K),
                beta.view(B, T, H), conv)

    def mix(self, q, k, v, g, beta, h0):
        node_major = [x.transpose(0, 1) for x in (q, k, v, g, beta)]
        parents = self.tree_parents.to(q.device)
        if q.is_cuda:
            from k3_kernels.replay_ssm.tree import tree_verify
            o, _ = tree_verify(h0.float(), *node_major, parents, paths=self.node_paths)
        else:
            from k3_kernels.replay_ssm.naive import naive_tree_verify
            o, _ = naive_tree_verify(h0.float(), *node_major, parents)
        return o.transpose(0, 1), h0

    def set_kda(self, layer, recurrent, conv):
        pass   # the committed state stays; the commit folds the accepted path


class TreeSpecView(TreeOps, SpecView):
    """SpecView of one batched token-tree verify: verify position i of row b is tree node i - 1 (position 0 the
    pending token), parents[b][i] its parent position (-1: the committed state); the latents of all positions go
    into the row's pages at pos + i (TreeOps for the rest)."""

    def __init__(self, eng: "Engine", rows: list["RunningSeq | None"], T: int, scratch: ReplayScratch,
                 row_of_seat: list[int | None], parents: list[list[int]]):
        super().__init__(eng, rows, T, 0, scratch, row_of_seat, {})
        W1 = eng.model.config.conv_kernel_size - 1
        self.tree_parents, self.anc, self.window_cols, *paths = tree_tensors(parents, T, W1)
        self.node_paths = tuple(x.to(eng.device) for x in paths)   # read by every KDA layer's tree kernel
        self.kda_tree = self


@dataclass
class VerifyResult:
    logits: list[list]   # [row][t] logits after position t (t < len(tokens[row])): device rows [vocab], NextLogits once walked
    # [row][t] routed experts of position t; from a batched verify on CUDA a non-blocking copy: complete once the
    # stream is synchronised (decode.step's first pick copy), not to be read before
    routing: list[list[torch.Tensor]]
    scratch: ReplayScratch
    forwards: int
    features: list[list[torch.Tensor]] | None = None   # [row][t] the target's drafter features of position t
    # batched verifies: every row's logits [rows, T, vocab] (logits[r][t] is a view of it), for one pick launch
    block: torch.Tensor | None = None


@contextlib.contextmanager
def _at_positions(rows: list["RunningSeq"], offset: int):
    """Temporarily place every row at pos0 + offset (PoolView reads `pos` for its page writes and key lengths)."""
    pos0 = [s.pos for s in rows]
    for s, p in zip(rows, pos0):
        s.pos = p + offset
    try:
        yield
    finally:
        for s, p in zip(rows, pos0):
            s.pos = p


def _picked(out, seats: list["RunningSeq | None"]) -> tuple[list[NextLogits], torch.Tensor | None]:
    """A decode-shaped verify forward's logits picked as plain decoding picks its rows' (`next_logits`), and its
    routed experts (int32) on the host in one copy (one copy per position was a device sync per position)."""
    routed = out.routed_experts
    on_host = [s is not None and s.req.params.temperature > 0 for s in seats]
    return (next_logits(out.logits[:, 0], on_host),
            routed.to(torch.int32).cpu() if routed is not None else None)


def _verify_forward(eng: "Engine", seats: list["RunningSeq | None"], row_of_seat: list[int | None], ids: torch.Tensor,
                    t0: int, scratch: ReplayScratch, working: dict, capture):
    """One target forward of verify positions [t0, t0 + ids.shape[1]) for the rows in `seats`."""
    live = [s for s in seats if s is not None]
    with _at_positions(live, t0):
        view = SpecView(eng, seats, ids.shape[1], t0, scratch, row_of_seat, working)
        with eng._adapters_for(seats), (capture if capture is not None else contextlib.nullcontext()):
            out = eng.model(ids.to(eng.device), view, return_routed_experts=True, check_ids=False)
        feats = capture.features() if capture is not None else None
    return out, feats


def verify_walk(eng: "Engine", rows: list["RunningSeq"], roots: list[int], max_positions: list[int],
                advance: Callable[[int, int, torch.Tensor], int | None], capture=None) -> VerifyResult:
    """EXACT verification of chains and token trees, with decode's shapes: forward t feeds every live row's current
    node (t = 0: the pending token `roots[r]`) as a [decode_batch, 1] decode step at position pos + t, so each node
    attends to the row's prefix and its ancestors only -- the nodes fed before it, in the row's pages -- and its KDA
    step starts from its parent's working state. After the forward, `advance(r, t, logits)` walks the acceptance
    one node down: the token of the child to feed next, or None (row r's walk ends; nothing else of its tree is
    ever computed). Only the walked path is computed, at most `max_positions[r]` positions (pages prepared), so a
    verify costs as many decode-shaped passes as the longest accepted path plus one, whatever the tree's width."""
    B = eng.cfg.decode_batch
    if len(rows) > B:
        raise ValueError(f"verify: {len(rows)} rows exceed decode_batch {B}")
    T = max(max_positions)
    scratch = ReplayScratch.allocate(eng.model.config, len(eng.kda_index), eng.dtype, len(rows), T, eng.device)
    row_of_seat: list[int | None] = list(range(len(rows))) + [None] * (B - len(rows))
    logits: list[list[torch.Tensor]] = [[] for _ in rows]
    routing: list[list[torch.Tensor]] = [[] for _ in rows]
    features: list[list[torch.Tensor]] | None = [[] for _ in rows] if capture is not None else None
    fed: list[int | None] = list(roots)
    working: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    forwards = 0
    for t in range(T):
        seats = [s if (r is not None and fed[r] is not None) else None
                 for s, r in zip(rows + [None] * (B - len(rows)), row_of_seat)]
        if all(s is None for s in seats):
            break
        ids = torch.zeros(B, 1, dtype=torch.long)
        for b, s in enumerate(seats):
            if s is not None:
                ids[b, 0] = fed[row_of_seat[b]]
        out, feats = _verify_forward(eng, seats, row_of_seat, ids, t, scratch, working, capture)
        forwards += 1
        step_logits, step_routing = _picked(out, seats)
        for b, s in enumerate(seats):
            if s is None:
                continue
            r = row_of_seat[b]
            logits[r].append(step_logits[b])
            if feats is not None:
                features[r].append(feats[b, 0])
            routing[r].append(step_routing[b, 0] if step_routing is not None else torch.zeros(0, dtype=torch.long))
            nxt = advance(r, t, step_logits[b])
            if nxt is not None and t + 1 >= max_positions[r]:
                raise RuntimeError(f"verify: row {r}'s walk went past its {max_positions[r]} prepared positions")
            fed[r] = nxt
    return VerifyResult(logits, routing, scratch, forwards, features)


def verify_batched(eng: "Engine", rows: list["RunningSeq"], tokens: list[list[int]], capture=None,
                   parents: list[list[int]] | None = None, width: int = 0) -> VerifyResult:
    """BATCHED verification: one [decode_batch, T] forward from the committed states (pages prepared for T
    positions), T = the longest row's tokens, at least `width`. Chains: `tokens[r]` = the pending token and the
    draft, causal (rows with shorter drafts repeat their last token). Token trees: `parents[r]` gives each
    position's parent position (TreeSpecView's tree mask and tree KDA); shorter rows are padded with positions
    chained to their last one."""
    B = eng.cfg.decode_batch
    if len(rows) > B:
        raise ValueError(f"verify: {len(rows)} rows exceed decode_batch {B}")
    T = max([len(t) for t in tokens] + [width])
    row_of_seat: list[int | None] = list(range(len(rows))) + [None] * (B - len(rows))
    seats = list(rows) + [None] * (B - len(rows))
    par = None if parents is None else [
        list(parents[r]) + list(range(len(parents[r]) - 1, T - 1)) if r < len(rows) else list(range(-1, T - 1))
        for r in range(B)]
    graphed = eng.graphs is not None and eng.graphs.accepts_verify(seats, tree=par is not None)
    scratch = None if graphed else ReplayScratch.allocate(eng.model.config, len(eng.kda_index), eng.dtype,
                                                          len(rows), T, eng.device)
    # one host tensor built from lists (not a few small tensor ops a row: host time the device waits for)
    ids = torch.tensor([list(toks) + [toks[-1]] * (T - len(toks)) for toks in tokens] + [[0] * T] * (B - len(rows)),
                       dtype=torch.long)
    if graphed:   # a captured verify (k3.rollout.graphs)
        out, scratch, feats = eng.graphs.verify(seats, ids, features=capture is not None, parents=par)
    elif parents is None:
        out, feats = _verify_forward(eng, seats, row_of_seat, ids, 0, scratch, {}, capture)
    else:
        with _at_positions(rows, 0):
            view = TreeSpecView(eng, seats, T, scratch, row_of_seat, par)
            with eng._adapters_for(seats), (capture if capture is not None else contextlib.nullcontext()):
                out = eng.model(ids.to(eng.device), view, return_routed_experts=True, check_ids=False)
            feats = capture.features() if capture is not None else None
    R = len(rows)
    routed = out.routed_experts
    # the routed experts come to the host without a sync of their own: the walk's first pick copy (same stream,
    # queued after this one) waits for both; nothing reads them before that (VerifyResult.routing's contract)
    all_routing = (routed[:R].to(torch.int32).to("cpu", non_blocking=True) if routed is not None else None)
    # per-position views by unbind (one op a row, not one a position: ~3 host ops a position were ~1/3 of the
    # step's idle device time at batch 8, benchmarks/step_trace.py); device rows: the acceptance walk copies the
    # rows it reaches to the host (decode.step)
    logits = [list(row.unbind(0))[:len(toks)] for row, toks in zip(out.logits[:R].unbind(0), tokens)]
    empty = torch.zeros(0, dtype=torch.long)
    routing = ([list(row.unbind(0))[:len(toks)] for row, toks in zip(all_routing.unbind(0), tokens)]
               if all_routing is not None else [[empty] * len(toks) for toks in tokens])
    features = (None if feats is None else
                [list(row.unbind(0))[:len(toks)] for row, toks in zip(feats[:R].unbind(0), tokens)])
    return VerifyResult(logits, routing, scratch, 1, features, out.logits[:R])


def keep_path(eng: "Engine", rows: list["RunningSeq"], res: VerifyResult, order: list[list[int]]) -> None:
    """After a batched tree verify: bring each row's walked positions `order[r]` (0, then its accepted path's node
    positions) to verify positions 0, 1, ...: the MLA latents in the row's pages (NoPE: a latent does not depend on
    its position), the stored KDA projections, logits, routing and features. The commit then keeps a chain."""
    P = eng.cfg.page_size
    store = eng.pages.dev["kv"]
    moves = [(s.pos + i, s.pos + j, s) for s, idx in zip(rows, order) for j, i in enumerate(idx) if i != j]
    if moves:   # one gather and one scatter for every row: each source is read before anything is written
        where = torch.tensor([[eng.pages.slot(s.bt[p // P]), p % P] for src, dst, s in moves for p in (src, dst)],
                             dtype=torch.long).to(store.device).view(len(moves), 2, 2)
        store[where[:, 1, 0], :, where[:, 1, 1]] = store[where[:, 0, 0], :, where[:, 0, 1]]
    for r, idx in enumerate(order):
        res.logits[r] = [res.logits[r][i] for i in idx]
        res.routing[r] = [res.routing[r][i] for i in idx]
        if res.features is not None:
            res.features[r] = [res.features[r][i] for i in idx]
    res.scratch.reorder(order)
