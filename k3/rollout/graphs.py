"""CUDA graphs for the engine's decode steps, speculative verifies and commits.

A decode step of the K3-width model launches ~630 kernels; eagerly the host spends ~3-4x the device time issuing
them (benchmarks/decode_profile.py). The engine's decode forward already has fixed shapes (`decode_batch` seats,
dummy rows in empty ones) and no host sync, so it is captured once per `GraphShape` (seats, tokens a seat,
page-table width) and replayed: what varies from step to step -- token ids, where each seat's new latents go, its
pages, its past length, its KDA state slot -- lives in one int64 device buffer that a single host-to-device copy
refills before each replay (`StaticView`). Idle seats point at the pools' spare page and spare state slot
(`TieredPool(spare=1)`), which no item owns; the spare state is zeroed at the start of every forward, so an idle
seat computes what the eager engine's dummy row computes (a zero state, its own keys only).

Speculative decoding (k3.rollout.spec) gets the same: the batched chain verify (`StaticVerifyView`: the step
inputs into a scratch shared by every verify shape of a seat count, the committed states only read), the commit
that follows it (one fold over every seat), and the trained drafter's chain steps (`CapturedCall`). Token-tree
verifies (`StaticTreeView`: parents, ancestor mask, conv-window columns and the KDA kernel's node paths in a static
buffer) are captured too (`DecodeGraphs(trees=False)` keeps them eager).

Replays are bitwise the eager forward: the same kernels with the same arguments. The attention key length is the
page-table width (a power-of-two number of pages >= the longest row's), not the eager view's page-rounded longest
row, which changes nothing a real row computes: the linears give each row its own bits whatever the row count
(k3_kernels.batch_invariant; on CPU row blocks) and the per-query MLA kernel reads exactly each query's keys.
`tests/rollout/test_graphs.py` checks it (eagerly on CPU, captured on the GPU).

Rows served through LoRA adapters (k3.lora) are captured as well (`DecodeGraphs(adapters=False)` keeps them eager):
each token's adapter slot is one more part of the index buffer,
the forward runs under the manager's captured plan (every added adapter stacked in the forward, so in-place
adapter updates are read at every replay; the per-token BGMV kernel, whose launches do not depend on the slots),
and the graphs are dropped when the adapter set changes (`LoRAManager.signature`). Forwards where no row has an
adapter replay the base graphs.

Not captured (eager as before): prefill chunks, adapters on routed experts (the per-expert adapter loop reads
routing on the host), exact-mode verify walks. Weights updated in place (`update_weights`, k3.sync
receivers) keep the graphs valid; replacing parameter tensors does not (call `reset`).
"""
from __future__ import annotations

import contextlib
import gc
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from k3.model.model import K3Output
from k3.rollout.spec.verify import TreeOps, tree_tensors
from k3.rollout.types import key_token

if TYPE_CHECKING:
    from k3.rollout.engine import Engine
    from k3.rollout.sequence import RunningSeq


def adapter_slot(eng: "Engine", row: "RunningSeq") -> int:
    """The LoRA slot a row's forward applies (-1: the base; also when an adapter is merged into the weights)."""
    lora, name = eng.lora, row.req.params.adapter_id
    return -1 if name is None or lora is None or lora.merged is not None else lora.slot(name)


def page_bucket(pages: int) -> int:
    """The page-table width a forward needing `pages` pages a row runs at: the next power of two (few graphs,
    at most 2x the keys)."""
    return 1 << max(pages - 1, 0).bit_length()


def _packed_rows(rows: list["RunningSeq | None"]) -> list:
    """What a pack of `rows` reads besides their tokens: each seat's row, position, pages and state (a prepared
    pack is reused only while all of them are unchanged)."""
    return [None if r is None else (id(r), r.pos, tuple(r.bt), r.state) for r in rows]


class IndexBuffer:
    """int64 values a captured graph reads: a device buffer (`parts`: its views of `sizes`) and a pinned host twin;
    `fill` writes the twin, `load` copies it over (one host-to-device copy before a replay)."""

    def __init__(self, device: torch.device, sizes: list[int]):
        self.host = torch.zeros(sum(sizes), dtype=torch.long, pin_memory=device.type == "cuda")
        self.buf = torch.zeros(sum(sizes), dtype=torch.long, device=device)
        self.parts = self.buf.split(sizes)

    def fill(self, values: "list[int] | torch.Tensor") -> None:
        self.host.copy_(values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.long))

    def load(self) -> None:
        self.buf.copy_(self.host, non_blocking=True)


def capture_graph(run: Callable, device: torch.device, pool=None):
    """`run()` captured as a CUDA graph after one warm-up run on a side stream (which builds the Triton kernels of
    these shapes outside the capture) -> (the graph, run's outputs, rewritten by every replay)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # no garbage collection inside the capture: a collected engine's graphs reset on destruction, which a capturing
    # stream forbids, and the capture is invalidated (seen on the H200 with several engines in one process)
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            out = run()
    finally:
        if collecting:
            gc.enable()
    return graph, out


class StaticView:
    """CacheView (k3.model.state) of a fixed-shape forward over the engine's pools: `seats` rows of `tokens`
    tokens, each row's pages in a table `pages` wide. Every index the forward reads sits in one device buffer
    (`pack` fills its host twin, `load` copies it over), so a captured graph reads this step's indices."""

    def __init__(self, eng: "Engine", seats: int, tokens: int, pages: int):
        self.eng, self.seats, self.tokens, self.pages = eng, seats, tokens, pages
        self.spare_page = eng.pages.spare_slots[0]
        self.spare_state = eng.states.spare_slots[0]
        B, T = seats, tokens
        self.index = IndexBuffer(eng.device, [B * T, B * T, B * T, B, B, B * pages, B * T])
        ids, self.w_slot, self.w_off, self.past, self.s_slots, table, self.adapter_slots = self.index.parts
        self.ids, self.table = ids.view(B, T), table.view(B, pages)

    def pack(self, rows: list["RunningSeq | None"], ids: torch.Tensor | None = None) -> None:
        """This forward's indices into the host buffer: a row's fed tokens (its key's, or `ids` [seats, tokens]),
        the page slot and offset of each of its new positions, its past length, its state slot and page slots, its
        LoRA adapter's slot (-1: none); idle seats (None) the spare page and state, past 0, no adapter."""
        eng, B, T, W = self.eng, self.seats, self.tokens, self.pages
        if len(rows) != B:
            raise ValueError(f"rows: expected {B} seats, got {len(rows)}")
        P = eng.cfg.page_size
        if ids is not None and tuple(ids.shape) != (B, T):
            raise ValueError(f"ids: expected [{B}, {T}], got {tuple(ids.shape)}")
        fed, w_slot, w_off, past, s_slots, table, adapters = [], [], [], [], [], [], []
        for r in rows:
            if r is None:
                fed += [0] * T if ids is None else []
                w_slot += [self.spare_page] * T
                w_off += [t % P for t in range(T)]
                past.append(0)
                s_slots.append(self.spare_state)
                table += [self.spare_page] * W
                adapters += [-1] * T
                continue
            n = math.ceil((r.pos + T) / P)
            if n > W:
                raise ValueError(f"rows: a row needs {n} pages, the table holds {W}")
            slots = [eng.pages.slot(pg) for pg in r.bt[:n]]
            fed += [key_token(k) for k in r.key[r.pos:r.pos + T]] if ids is None else []
            w_slot += [slots[(r.pos + t) // P] for t in range(T)]
            w_off += [(r.pos + t) % P for t in range(T)]
            past.append(r.pos)
            s_slots.append(eng.states.slot(r.state))
            table += slots + [self.spare_page] * (W - n)
            adapters += [adapter_slot(eng, r)] * T
        if ids is not None:
            fed = ids.reshape(-1).tolist()
        self.index.fill(fed + w_slot + w_off + past + s_slots + table + adapters)

    def set_ids(self, ids: torch.Tensor) -> None:
        """The fed tokens [seats, tokens] of a view `pack` already filled (every other index unchanged)."""
        B, T = self.seats, self.tokens
        if tuple(ids.shape) != (B, T):
            raise ValueError(f"ids: expected [{B}, {T}], got {tuple(ids.shape)}")
        self.index.host[:B * T].copy_(ids.reshape(-1))

    def load(self) -> None:
        self.index.load()

    def clear_spare(self) -> None:
        """Idle seats start from a zero state (as the eager view's dummy rows do)."""
        for store in self.eng.states.dev.values():
            store[self.spare_state].zero_()

    # ------------------------------------------------------------------ CacheView
    def mla(self, layer, c_kv, k_pe):
        store = self.eng.pages.dev["kv"]
        li = self.eng.mla_index[layer]
        new = torch.cat([c_kv, k_pe], dim=-1)
        B, T, D = new.shape
        store[self.w_slot, li, self.w_off] = new.reshape(B * T, D).to(store.dtype)
        keys = store[self.table, li].reshape(B, self.pages * store.shape[2], D)   # [B, W pages, P, D] rows
        return keys[..., :c_kv.shape[-1]], keys[..., c_kv.shape[-1]:], self.past

    def kda(self, layer):
        ki = self.eng.kda_index[layer]
        return self.eng.states.dev["rec"][self.s_slots, ki], self.eng.states.dev["conv"][self.s_slots, ki]

    def set_kda(self, layer, recurrent, conv):
        ki = self.eng.kda_index[layer]
        rec_store, conv_store = self.eng.states.dev["rec"], self.eng.states.dev["conv"]
        rec_store[self.s_slots, ki] = recurrent.to(rec_store.dtype)
        conv_store[self.s_slots, ki] = conv.to(conv_store.dtype)


class StaticVerifyView(StaticView):
    """StaticView of a batched chain verify (k3.rollout.spec.verify): the committed states are read, never
    written; every KDA layer's step inputs of every seat go to a scratch of `seats` rows (the commit reads the
    running rows' part) -- the verify's `SpecView` with fixed shapes."""

    def __init__(self, eng: "Engine", seats: int, tokens: int, pages: int, scratch):
        super().__init__(eng, seats, tokens, pages)
        if scratch.rows != seats or scratch.positions < tokens:
            raise ValueError(f"scratch: {scratch.rows} rows x {scratch.positions} positions cannot hold a verify of "
                             f"{seats} seats x {tokens} tokens")
        self.scratch = scratch

    def set_kda(self, layer, recurrent, conv):
        pass   # the commit folds the accepted positions into the committed state

    def record_kda_inputs(self, layer, conv_in, f, b):
        self.scratch.store_seats(self.eng.kda_index[layer], conv_in, f, b)


class StaticTreeView(TreeOps, StaticVerifyView):
    """StaticVerifyView of a batched token-tree verify: the tree's parents, ancestor mask and conv-window columns
    (k3.rollout.spec.verify.tree_tensors) in a second static buffer, refilled with the indices (`pack_tree`)."""

    def __init__(self, eng: "Engine", seats: int, tokens: int, pages: int, scratch):
        super().__init__(eng, seats, tokens, pages, scratch)
        B, T, W1 = seats, tokens, eng.model.config.conv_kernel_size - 1
        self.tree_index = IndexBuffer(eng.device, [B * T, B * T * T, B * T * W1, B * T * T, B * T])
        parents, anc, cols, paths, depths = self.tree_index.parts
        self.tree_parents, self._anc, self.window_cols = parents.view(B, T), anc.view(B, T, T), cols.view(B, T, W1)
        self.node_paths = (paths.view(B, T, T), depths.view(B, T))
        self.kda_tree = self

    @property
    def anc(self) -> torch.Tensor:
        return self._anc.bool()

    def pack_tree(self, parents: list[list[int]]) -> None:
        W1 = self.window_cols.shape[-1]
        self.tree_index.fill(torch.cat([x.reshape(-1).long() for x in tree_tensors(parents, self.tokens, W1)]))

    def load(self) -> None:
        super().load()
        self.tree_index.load()


@dataclass(frozen=True)
class GraphShape:
    """What a captured forward is specialised to."""
    seats: int
    tokens: int            # a seat's tokens (1: decode; a verify's pending token and draft)
    pages: int             # page-table width
    verify: bool = False   # a chain verify (StaticVerifyView) instead of a decode step
    features: bool = False  # also the drafter's features of every position (k3.rollout.spec.drafter)
    tree: bool = False     # a token-tree verify (StaticTreeView)
    adapters: tuple[int, ...] | None = None   # the LoRA adapters' slots (LoRAManager.signature); None: the base


@dataclass(frozen=True)
class CommitShape:
    """A captured commit: the verify whose scratch it folds, and the positions it rebuilds (the longest accept)."""
    verify: GraphShape
    steps: int


@dataclass
class _Commit:
    index: IndexBuffer     # [2 seats]: state slots, then accepted counts
    run: Callable[[], None]
    graph: "torch.cuda.CUDAGraph | None" = None


@dataclass
class _Shape:
    view: StaticView
    run: Callable[[], tuple[K3Output, torch.Tensor | None]]
    graph: "torch.cuda.CUDAGraph | None" = None
    out: tuple[K3Output, torch.Tensor | None] | None = None


class DecodeGraphs:
    """The engine's captured decode forwards, batched verifies and commits, one per shape, made on first use
    (a one-token prefill segment past a chunk boundary is a [1, 1] forward of the decode kind).
    `capture=False` runs the same fixed-shape forwards eagerly (CPU tests of the views; no CUDA graph)."""

    def __init__(self, eng: "Engine", capture: bool = True, trees: bool = True, adapters: bool = True):
        """`trees`: capture token-tree verifies (StaticTreeView) and the drafter's tree levels too; `adapters`: rows
        served through LoRA adapters too (a captured LoRAManager plan). Off: those run eagerly."""
        if capture and eng.device.type != "cuda":
            raise ValueError(f"DecodeGraphs: capture needs a CUDA engine, this one is on {eng.device}")
        self.eng, self.capture, self.trees, self.adapters = eng, capture, trees, adapters
        self._signature: tuple[int, ...] | None = None   # the adapter set the graphs were made for
        self.shapes: dict[GraphShape, _Shape] = {}
        self.commits: dict[CommitShape, _Commit] = {}
        self._served: tuple[object, GraphShape] | None = None   # the last verify's scratch (handed out) and shape
        # (shape, `_packed_rows`) of the verify `prepare_verify` packed; the next replay of it writes only the ids
        self._prepared: tuple[GraphShape, list] | None = None
        # seats -> the verify scratch every verify shape of that many seats shares (read by the commit before the
        # next verify): one allocation of `seats` rows x the widest verify, not one per (width, pages)
        self._scratch: dict[int, object] = {}
        self._pool = None
        self.stats = {"captures": 0, "replays": 0, "prepared_verifies": 0}

    def accepts(self, rows: list["RunningSeq | None"], tokens: int) -> bool:
        """A decode-shaped forward: one token a seat, every row past position 0, the base model (no adapters)."""
        return tokens == 1 and self.accepts_verify(rows)

    def accepts_verify(self, rows: list["RunningSeq | None"], tree: bool = False) -> bool:
        """Rows past position 0 (a verify's always are); token trees when `trees` is on; with a LoRA manager
        attached only when `adapters` is on (then rows with an adapter when none targets routed experts)."""
        lora = self.eng.lora
        return ((self.trees or not tree) and any(r is not None for r in rows)
                and all(r is None or r.pos > 0 for r in rows)
                and (lora is None or (self.adapters and (self._adapter_key(rows) is None or lora.capturable()))))

    def _adapter_key(self, rows: list["RunningSeq | None"]) -> tuple[int, ...] | None:
        """GraphShape.adapters of a forward of `rows`: the adapter set when a row has an adapter, else None (at once
        without a LoRA manager: no per-row look-up on every decode step)."""
        if self.eng.lora is not None and any(r is not None and adapter_slot(self.eng, r) >= 0 for r in rows):
            return self.eng.lora.signature()
        return None

    def forward(self, rows: list["RunningSeq | None"], tokens: int) -> K3Output:
        """The forward of `rows` (seats; None = idle) -> K3Output(logits [B, T, V], None, routed experts), copies
        that outlive the next replay."""
        key = GraphShape(len(rows), tokens, self._pages(rows, tokens), adapters=self._adapter_key(rows))
        out, _ = self._replay(rows, key, None, None)
        return out

    def verify(self, rows: list["RunningSeq | None"], ids: torch.Tensor, features: bool,
               parents: list[list[int]] | None = None):
        """A batched verify of `ids` [seats, T] (host; a row's pending token and draft: a chain, or with `parents`
        [seats][T] a token tree) from the committed states -> (K3Output, the scratch's first len(running rows)
        rows, the drafter features [seats, T, 3d] or None). The scratch is the graphs' own: read it (the commit)
        before the next verify."""
        T = ids.shape[1]
        key = GraphShape(len(rows), T, self._pages(rows, T), True, features, parents is not None,
                         self._adapter_key(rows))
        out, feats = self._replay(rows, key, ids, parents)
        live = sum(r is not None for r in rows)
        scratch = self.shapes[key].view.scratch.first_rows(live)
        self._served = (scratch, key)
        return out, scratch, feats

    def prepare_verify(self, rows: list["RunningSeq | None"], tokens: int, features: bool) -> bool:
        """A chain verify of `rows` (seats) at `tokens` positions packed before its tokens are known (the drafter
        still running): the next `verify` of the same rows and shape only writes the ids. False when such a
        verify is not captured (nothing done)."""
        if not self.accepts_verify(rows):
            return False
        key = GraphShape(len(rows), tokens, self._pages(rows, tokens), True, features, False, self._adapter_key(rows))
        shape = self._shape(key)
        shape.view.pack(rows, torch.zeros(len(rows), tokens, dtype=torch.long))
        self._prepared = (key, _packed_rows(rows))
        return True

    def commit(self, rows: list["RunningSeq"], scratch, n_commit: list[int]) -> bool:
        """k3.rollout.spec.commit.commit of `rows` (in seats 0..) from the scratch of the last captured verify,
        as a captured fold over every seat (idle seats: the spare state, nothing accepted): True when it ran;
        False for any other scratch (an eager verify's), which the caller commits itself."""
        if self._served is None or self._served[0] is not scratch:
            return False
        verify = self._served[1]
        self._served = None
        key = CommitShape(verify, max(n_commit))
        commit = self.commits.get(key) or self._build_commit(key)
        eng, B = self.eng, verify.seats
        spare = eng.states.spare_slots[0]
        slots = [eng.states.slot(s.state) for s in rows] + [spare] * (B - len(rows))
        commit.index.fill(slots + list(n_commit) + [0] * (B - len(rows)))
        commit.index.load()
        if commit.graph is None:
            commit.run()
        else:
            commit.graph.replay()
        self.stats["replays"] += 1
        return True

    def reset(self) -> None:
        """Drop every captured graph (after parameters were replaced by new tensors)."""
        self.shapes.clear()
        self.commits.clear()
        self._scratch.clear()
        self._served = None
        self._prepared = None
        self._pool = None

    def _pages(self, rows, tokens: int) -> int:
        P = self.eng.cfg.page_size
        return page_bucket(max(math.ceil((r.pos + tokens) / P) for r in rows if r is not None))

    def _shape(self, key: GraphShape) -> _Shape:
        """The captured forward of `key` (made on first use), after dropping every graph if the adapter set
        changed."""
        lora = self.eng.lora
        signature = lora.signature() if lora is not None else None
        if signature != self._signature:   # adapters added, removed, merged: graphs of other sets are stale
            self.reset()
            self._signature = signature
        return self.shapes.get(key) or self._build(key)

    def _replay(self, rows, key: GraphShape, ids: torch.Tensor | None, parents: list[list[int]] | None):
        shape = self._shape(key)
        prepared, self._prepared = self._prepared, None
        if ids is not None and prepared == (key, _packed_rows(rows)):   # packed by prepare_verify
            shape.view.set_ids(ids)
            self.stats["prepared_verifies"] += 1
        else:
            shape.view.pack(rows, ids)
        if key.tree:
            shape.view.pack_tree(parents)
        shape.view.load()
        if shape.graph is None:
            out, feats = shape.run()
        else:
            shape.graph.replay()
            out, feats = shape.out
        self.stats["replays"] += 1
        routed = out.routed_experts
        return (K3Output(out.logits.clone(), None, routed.clone() if routed is not None else None),
                feats.clone() if feats is not None else None)

    def _verify_scratch(self, seats: int, tokens: int):
        from k3.rollout.spec.scratch import ReplayScratch
        spec = self.eng.cfg.speculative
        most = tokens if spec is None else (spec.tree_nodes if spec.branching > 1 else spec.draft_len) + 1
        widest = max(tokens, most)   # the pending token and the most draft positions a verify holds
        have = self._scratch.get(seats)
        if have is None or have.positions < tokens:
            have = self._scratch[seats] = ReplayScratch.allocate(self.eng.model.config, len(self.eng.kda_index),
                                                                 self.eng.dtype, seats, widest, self.eng.device)
        return have

    def _build(self, key: GraphShape) -> _Shape:
        if key.verify:
            view = (StaticTreeView if key.tree else StaticVerifyView)(self.eng, key.seats, key.tokens, key.pages,
                                                                    self._verify_scratch(key.seats, key.tokens))
        else:
            view = StaticView(self.eng, key.seats, key.tokens, key.pages)
        model, lora = self.eng.model, self.eng.lora
        if key.adapters is not None:   # each token's adapter slot read from the index buffer
            plan = lora.captured_plan(view.adapter_slots, key.seats, key.tokens)
            adapters = lambda: lora.use_plan(plan)   # noqa: E731
        elif lora is not None and lora.merged is None:   # no row has an adapter: the base (as the eager engine)
            adapters = lambda: lora.use(None)   # noqa: E731
        else:
            adapters = contextlib.nullcontext

        def run() -> tuple[K3Output, torch.Tensor | None]:
            view.clear_spare()
            with adapters():
                if not key.features:
                    return model(view.ids, view, return_routed_experts=True, check_ids=False), None
                from k3.rollout.spec.drafter import FeatureCapture
                with FeatureCapture(model) as capture:
                    out = model(view.ids, view, return_routed_experts=True, check_ids=False)
                return out, capture.features()

        shape = _Shape(view, run)
        if self.capture:
            def idle():   # warm up and capture on idle seats: only the spare page and state change
                view.pack([None] * key.seats)
                if key.tree:
                    view.pack_tree([list(range(-1, key.tokens - 1))] * key.seats)   # idle seats: a chain
                view.load()
            shape.graph, shape.out = self._captured(run, idle)
        self.shapes[key] = shape
        return shape

    def _build_commit(self, key: CommitShape) -> _Commit:
        from k3.rollout.spec.commit import fold_and_write
        eng, B = self.eng, key.verify.seats
        scratch = self.shapes[key.verify].view.scratch   # every seat's step inputs
        index = IndexBuffer(eng.device, [B, B])
        slots, n_seat = index.parts

        def run() -> None:
            fold_and_write(eng, scratch, slots, n_seat, key.steps, B)

        commit = _Commit(index, run)
        if self.capture:
            def idle():   # every seat on the spare state, nothing accepted: only the spare state is written
                index.fill([eng.states.spare_slots[0]] * B + [0] * B)
                index.load()
            commit.graph, _ = self._captured(run, idle)
        self.commits[key] = commit
        return commit

    def _captured(self, run: Callable, idle: Callable[[], None]):
        """`capture_graph` of `run` on `idle` inputs, in the one memory pool of all shapes (each replay's outputs
        are copied or consumed before the next replay)."""
        idle()
        graph, out = capture_graph(run, self.eng.device, self._pool)
        self._pool = graph.pool()
        self.stats["captures"] += 1
        return graph, out


class CapturedCall:
    """`fn(*inputs) -> tensor` as a CUDA graph for the shapes and dtypes of `inputs` (a small host-bound loop such
    as the trained drafter's draft steps): a call copies its inputs into the captured ones and replays; the result
    is a copy. `capture=False` (CPU) calls `fn` itself."""

    def __init__(self, fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], capture: bool = True):
        self.fn, self.capture = fn, capture
        self.static = tuple(x.clone() for x in inputs)
        self.graph, self.out = None, None
        if capture:
            self.graph, self.out = capture_graph(lambda: fn(*self.static), self.static[0].device)

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        if len(inputs) != len(self.static) or any(x.shape != s.shape or x.dtype != s.dtype
                                                  for x, s in zip(inputs, self.static)):
            raise ValueError(f"CapturedCall: inputs {[tuple(x.shape) for x in inputs]} do not match the captured "
                             f"{[tuple(s.shape) for s in self.static]}")
        if self.graph is None:
            return self.fn(*inputs)
        for s, x in zip(self.static, inputs):
            s.copy_(x)
        self.graph.replay()
        return self.out.clone()

