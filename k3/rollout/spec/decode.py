"""Speculative decode step of the embedded engine: draft (a chain or a token tree), verify (verify.py) while walking
the acceptance down the tree (accept.py), commit the accepted path.

The commit is ReplaySSM (commit.py): only committed states ever reach the state pool, so the prefix cache
(checkpoints, turn ends) only ever sees committed states.

Drafts never cross a position where plain decoding would checkpoint (every `checkpoint_interval` tokens, branch
points): the prefix cache holds the same entries with and without speculation. Drafts also stop one short of the
request's token budget.
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from k3.rollout.sampler import NextLogits, next_logits
from k3.rollout.spec.accept import Emitted, accept_at_node
from k3.rollout.spec.commit import commit
from k3.rollout.spec.config import Acceptance, DrafterDtype, SpecConfig, SpecMethod, VerifyMode
from k3.rollout.spec.ngram import NgramDrafter, SuffixIndex
from k3.rollout.spec.tree import DraftTree, build_tree
from k3.rollout.spec.verify import keep_path, verify_batched, verify_walk
from k3.rollout.types import key_token

if TYPE_CHECKING:
    from k3.rollout.engine import Engine
    from k3.rollout.sequence import RunningSeq

SPEC_STATS = ("spec_verifies", "spec_draft_tokens", "spec_accepted_tokens", "spec_emitted_tokens",
              "spec_scratch_bytes_max", "spec_predrafted")


class SpecDecoder:
    def __init__(self, eng: "Engine", cfg: SpecConfig):
        cfg.validate()
        self.eng, self.cfg = eng, cfg
        # method=drafter with `lookup`: prompt lookup beside the head (`_with_lookup`), suffixes of one token and up
        self.lookup = bool(cfg.lookup) and cfg.method is SpecMethod.DRAFTER
        if cfg.method is SpecMethod.NGRAM:
            self.drafter = NgramDrafter(cfg.ngram_max, cfg.ngram_min)
        else:
            from k3.rollout.spec.drafter import load_drafter
            dtype = cfg.drafter_dtype.resolved(eng.device.type)
            self.drafter = load_drafter(cfg.drafter_path, eng.model, dtype.torch_dtype(eng.dtype),
                                        fp8_weights=dtype is DrafterDtype.FLOAT8)
            if eng.graphs is not None:   # the chain's draft steps as CUDA graphs too
                self.drafter.capture_graphs(trees=eng.graphs.trees)
        self.features: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # seq -> its latest features
        # seq -> its sequence's n-gram index (prompt lookup and the n-gram drafter), extended step by step
        self.contexts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # request -> its prompt's last-position features (what a row's first decode step of a turn drafts from)
        self.prompt_features: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # Draft each continuing row's next chain right after the walk (`_predraft`), before the commit and the emit
        # loop: the trained head's chain steps are launched then (on CUDA on a side stream that waits for the
        # verify, not for the commit; the engine's stream joins it once the commit is queued, so the two run side
        # by side) and the next step takes the drafts from pinned host memory. Same drafts as drafting at the next
        # step (same features, last token, limit and kernels; on CUDA up to the head's GEMMs being invariant to the
        # row count); chains of a batched head only. Off by default until measured on the H200 (session 28's
        # version, launched after the emit loop, measured the same as drafting at the next step; NOTES.md).
        self.overlap_drafting = False
        self._draft_stream = None
        # seq -> (the position its draft is for, host drafts [rows, draft_len], its row, an event or None)
        self.predrafts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        for k in SPEC_STATS:
            eng.stats.setdefault(k, 0)

    # ------------------------------------------------------------------ prompt features
    @staticmethod
    def _prompt_ends(s: "RunningSeq | None", T: int) -> bool:
        """Row `s`'s prompt ends in its next T tokens (before the forward advances it)."""
        return s is not None and not s.sampling and s.pos + T == len(s.key)

    def prefill_capture(self, rows: list["RunningSeq | None"], T: int):
        """A FeatureCapture for a prefill forward of T tokens per row when some row's prompt ends in it and the
        drafter drafts from the target's features; else None (the forward runs without hooks)."""
        if not getattr(self.drafter, "needs_features", False) or not any(self._prompt_ends(s, T) for s in rows):
            return None
        from k3.rollout.spec.drafter import FeatureCapture
        return FeatureCapture(self.eng.model)

    def keep_prompt_features(self, rows: list["RunningSeq | None"], T: int, capture) -> None:
        """After the forward (rows' positions not yet advanced): the features of each ending prompt's last
        position, for its request's first decode step."""
        feats = capture.features()
        for b, s in enumerate(rows):
            if self._prompt_ends(s, T):
                self.prompt_features[s.req] = feats[b, -1].clone()

    # ------------------------------------------------------------------ drafting
    def draft_limit(self, s: "RunningSeq", pos: int | None = None, produced: int | None = None) -> int:
        """Draft tokens row `s` may verify now (or at position `pos` with `produced` tokens out: its next step, seen
        before its tokens are emitted): one short of its remaining budget, and never past the next position where
        plain decoding checkpoints."""
        eng = self.eng
        pos = s.pos if pos is None else pos
        produced = len(s.out_tokens) if produced is None else produced
        k = min(self.cfg.draft_len, s.req.params.max_tokens - produced - 1)
        if eng.prefix_cache:
            interval = eng.cfg.checkpoint_interval
            nxt = (pos // interval + 1) * interval
            nxt = min([nxt] + [b for b in s.branch_at if b > pos])
            k = min(k, nxt - pos - 1)
        return max(k, 0)

    def _propose(self, s: "RunningSeq", k: int) -> DraftTree:
        """Row `s`'s draft: a chain of <= k tokens, or a token tree of depth <= k within the configured shape."""
        if k == 0:
            return DraftTree()
        cfg = self.cfg
        nodes = cfg.tree_nodes if cfg.branching > 1 else k
        if getattr(self.drafter, "needs_features", False):
            feat = self._features_of(s)
            if feat is None:
                return DraftTree()
            if cfg.branching == 1:
                tree = DraftTree.chain(self.drafter.propose_tokens(feat, key_token(s.key[s.pos]), k))
            else:
                tree = self.drafter.propose_tree(feat, key_token(s.key[s.pos]), cfg.branching, k, nodes)
        elif isinstance(self.drafter, NgramDrafter):
            index = self._context(s)
            tree = (DraftTree.chain(index.match(k)[0]) if cfg.branching == 1
                    else build_tree(index.paths(k), cfg.branching, k, nodes))
        else:
            context = [key_token(x) for x in s.key]
            if cfg.branching == 1 or not hasattr(self.drafter, "propose_tree"):   # chains; chain-only drafters
                tree = DraftTree.chain(self.drafter.propose(context, k))
            else:
                tree = self.drafter.propose_tree(context, cfg.branching, k, nodes)
        return self._checked(tree, k)

    def _propose_group(self, group: list["RunningSeq"], speculating: list[bool],
                       meanwhile: Callable[[int], None] | None = None) -> list[DraftTree]:
        """Every row's draft; a trained drafter's chains or trees for the whole group in one batched pass per draft
        step (`launch_chains` / `propose_trees`), the other drafters row by row (`_propose`). Chains of the batched
        head: `meanwhile(width)` runs once the head's steps are queued and before their drafts are waited for
        (the step's host work that does not need the drafts, done while the device drafts), with `width` = 1 +
        the longest draft limit, which no row's chain exceeds."""
        cfg = self.cfg
        limits = [self.draft_limit(s) if spec else 0 for s, spec in zip(group, speculating)]
        if cfg.branching == 1 and hasattr(self.drafter, "launch_chains"):
            return self._propose_chains(group, limits, meanwhile)
        batched = getattr(self.drafter, "propose_trees", None) if cfg.branching > 1 else None
        if batched is None:
            return [self._propose(s, k) if spec else DraftTree() for s, k, spec in zip(group, limits, speculating)]
        trees = [DraftTree() for _ in group]
        found, feats = self._head_inputs(group, limits)
        rows = [r for r, f in enumerate(feats) if f is not None]
        if rows:
            last = [key_token(group[r].key[group[r].pos]) for r in rows]
            stacked = torch.stack([feats[r].reshape(-1) for r in rows])
            drafted = batched(stacked, last, cfg.branching, [limits[r] for r in rows], cfg.tree_nodes)
            for r, tree in zip(rows, drafted):
                trees[r] = self._checked(tree, limits[r])
        return self._looked_up(group, trees, limits, found)

    def _propose_chains(self, group: list["RunningSeq"], limits: list[int],
                        meanwhile: Callable[[int], None] | None) -> list[DraftTree]:
        """`_propose_group` for chains of the batched head: the rows pre-drafted at their previous step
        (`_predraft`) take those drafts, the others' head steps are launched for all of them at once (their drafts
        copied to pinned host memory behind an event on CUDA), then `meanwhile`, then the drafts are read."""
        found, feats = self._head_inputs(group, limits)
        pre, rows = {}, []
        for r, f in enumerate(feats):
            got = self._predraft_of(group[r]) if f is not None else None
            if got is not None:   # drafted at the end of the row's previous step
                pre[r] = got
            elif f is not None:
                rows.append(r)
        launched = None
        if rows:
            last = [key_token(group[r].key[group[r].pos]) for r in rows]
            stacked = torch.stack([feats[r].reshape(-1) for r in rows])
            launched = _to_host(self.drafter.launch_chains(stacked, last, max(limits[r] for r in rows)))
        if meanwhile is not None:
            meanwhile(1 + max(limits, default=0))
        trees = [DraftTree() for _ in group]
        for r, (host, row, event) in pre.items():
            if event is not None:
                event.synchronize()   # the head's steps and their copy, not the commit beside them
            self.eng.stats["spec_predrafted"] += 1
            trees[r] = self._checked(DraftTree.chain(host[row, :limits[r]].tolist()), limits[r])
        if launched is not None:
            host, event = launched
            if event is not None:
                event.synchronize()
            for r, chain in zip(rows, host.tolist()):
                trees[r] = self._checked(DraftTree.chain(chain[:limits[r]]), limits[r])
        return self._looked_up(group, trees, limits, found)

    def _looked_up(self, group: list["RunningSeq"], trees: list[DraftTree], limits: list[int],
                   found: list[tuple[list[int], int]]) -> list[DraftTree]:
        """With prompt lookup: each row's head draft combined with its lookup match (`_with_lookup`)."""
        if not self.lookup:
            return trees
        return [self._checked(self._with_lookup(s, t, k, found[r]), k) if k else t
                for r, (s, t, k) in enumerate(zip(group, trees, limits))]

    def _head_inputs(self, group: list["RunningSeq"], limits: list[int]
                     ) -> tuple[list[tuple[list[int], int]], list[torch.Tensor | None]]:
        """For rows with draft limits `limits`: each row's prompt-lookup match (tokens, suffix length; ([], 0)
        without lookup) and the features the trained head drafts it from, None where the head does not run (no
        draft, no features, or -- chains -- a row whose sequence repeats a suffix of >= `lookup` tokens: it drafts
        that continuation whatever the head says, `_with_lookup`)."""
        found = [self._context(s).match(k) if self.lookup and k else ([], 0) for s, k in zip(group, limits)]
        feats = [self._features_of(s) if k and not self._copies(f) else None
                 for s, k, f in zip(group, limits, found)]
        return found, feats

    def _copies(self, found: tuple[list[int], int]) -> bool:
        """A chain whose prompt-lookup match `found` (tokens, suffix length) is trusted: the row drafts that
        continuation whatever the head says (`_with_lookup`), so the head does not run for it."""
        return self.lookup and self.cfg.branching == 1 and found[1] >= self.cfg.lookup

    def _predraft_of(self, s: "RunningSeq") -> tuple[torch.Tensor, int, "torch.cuda.Event | None"] | None:
        """Row `s`'s chain drafted at the end of its previous step (`_predraft`), if it was drafted for the row's
        current position: (host drafts [rows, steps], its row, the event they wait for); else None."""
        got = self.predrafts.pop(s, None)
        if got is None or got[0] != s.pos:
            return None
        return got[1:]

    def _predraft(self, group: list["RunningSeq"], speculating: list[bool], verified, emitted: list[list[Emitted]],
                  features: list[list[torch.Tensor]] | None, n_commit: list[int]) -> "torch.cuda.Stream | None":
        """`overlap_drafting`, right after the walk, before the commit is queued and the rows' tokens are emitted:
        the trained head's next chain of every row that goes on speculating and would run the head at its next
        step -- what `_propose_group` drafts then, from the same features (its last committed position's), last
        token and draft limit, for the same rows (not finishing here; a draft limit above 0; with prompt lookup, a
        sequence whose trusted suffix match would be copied instead: its index is extended by this step's tokens
        now) -- launched now. On CUDA on a side stream that waits for `verified` (an event recorded after the
        verify), returned: the caller queues the commit, then makes the engine's stream wait for it, so the head
        runs beside the commit while the host emits, and the next verify follows both. The drafts go to pinned
        host memory behind an event. None when nothing was launched on a side stream."""
        cfg = self.cfg
        if not (self.overlap_drafting and cfg.branching == 1 and hasattr(self.drafter, "launch_chains")) \
                or features is None:
            return None
        rows, feats, lasts, limits = [], [], [], []
        for r, s in enumerate(group):
            em = emitted[r]
            if not speculating[r] or not em or _finishes(s, em):
                continue
            pos = s.pos + n_commit[r]
            k = self.draft_limit(s, pos, len(s.out_tokens) + len(em))
            if k == 0:
                continue
            if self.lookup:   # the index as the next step sees it (its tokens then are in the row's key)
                index = self._context(s)
                index.extend([e.token for e in em])
                if self._copies(index.match(k)):
                    continue
            rows.append((s, pos))
            feats.append(features[r][n_commit[r] - 1])
            lasts.append(em[-1].token)
            limits.append(k)
        if not rows:
            return None
        side = None
        if self.eng.device.type == "cuda":
            if self._draft_stream is None:
                self._draft_stream = torch.cuda.Stream(self.eng.device)
            side = self._draft_stream
            side.wait_event(verified)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            host, event = _to_host(self.drafter.launch_chains(torch.stack([f.reshape(-1) for f in feats]), lasts,
                                                              max(limits)))
        for i, (s, pos) in enumerate(rows):
            self.predrafts[s] = (pos, host, i, event)
        return side

    def _features_of(self, s: "RunningSeq") -> torch.Tensor | None:
        """The target's features a row's next draft starts from: its last committed position's, or on the turn's
        first decode step its prompt's last position's (None: not captured)."""
        feat = self.features.get(s)
        return feat if feat is not None else self.prompt_features.get(s.req)

    def _with_lookup(self, s: "RunningSeq", head: DraftTree, k: int, found: tuple[list[int], int]) -> DraftTree:
        """The head's draft `head` of row `s` combined with prompt lookup over the row's sequence (copies, which the
        head cannot make): `found` = the row index's match(k), (tokens, suffix length). A suffix of >= `lookup`
        tokens found earlier is trusted: its continuation comes first; a shorter one only when its first token is
        the head's first choice. Chains take one of the two; trees merge the paths (the preferred source's first,
        then the other's; at most `branching` children a node)."""
        cfg = self.cfg
        tokens, n = found
        if n == 0:
            return head
        head_first = [head.tokens[c] for c in head.children(-1)][:1]
        trusted = n >= cfg.lookup or tokens[:1] == head_first or not len(head)
        if cfg.branching == 1:
            return DraftTree.chain(tokens) if trusted else head
        copies = build_tree(self._context(s).paths(k), cfg.branching, k, cfg.tree_nodes)
        ordered = sorted(range(len(head)), key=lambda i: (-len(head.path(i)), i))   # deepest first, BFS order
        head_paths = [[head.tokens[j] for j in head.path(i)] for i in ordered if not head.children(i)]
        lookup_paths = [[copies.tokens[j] for j in copies.path(i)] for i in range(len(copies))
                        if not copies.children(i)]
        paths = lookup_paths + head_paths if trusted else head_paths[:1] + lookup_paths + head_paths[1:]
        return build_tree(paths, cfg.branching, k, cfg.tree_nodes)

    def _context(self, s: "RunningSeq") -> SuffixIndex:
        """Row `s`'s sequence (its pending token included) as an n-gram index, extended by the tokens appended
        since its last step (a row's keys only grow)."""
        index = self.contexts.get(s)
        if index is None or len(index.tokens) > len(s.key):
            cfg = self.cfg
            index = self.contexts[s] = SuffixIndex(cfg.ngram_max, 1 if self.lookup else cfg.ngram_min)
        if len(s.key) > len(index.tokens):
            index.extend([key_token(x) for x in s.key[len(index.tokens):]])
        return index

    def _checked(self, tree: DraftTree, k: int) -> DraftTree:
        """The drafter's tree, refused (ValueError naming the drafter) outside the configured shape or with a token
        outside the vocabulary: the verify forward feeds drafts unchecked (the engine range-checks ids on the host)."""
        cfg = self.cfg
        nodes = cfg.tree_nodes if cfg.branching > 1 else k
        if not tree.fits(cfg.branching, k) or len(tree) > nodes:
            raise ValueError(f"drafter: proposed a tree of {len(tree)} nodes, depth {tree.depth}, outside the "
                             f"speculative shape {cfg.shape} (draft limit {k})")
        V = self.eng.model.config.vocab_size
        bad = [t for t in tree.tokens if not 0 <= t < V]
        if bad:
            raise ValueError(f"drafter: proposed token ids outside the vocabulary [0, {V}): {bad[:4]}")
        return tree

    # ------------------------------------------------------------------ one decode group
    def step(self, group: list["RunningSeq"]) -> None:
        eng = self.eng
        # rows recomputing a history's decode span (prefix cache off, or past its hit) feed known tokens: no draft
        speculating = [s.sampling and s.pending == 1 for s in group]
        batched = self.cfg.verify is VerifyMode.BATCHED
        prepared: list[int] = []   # the verify width prepared while the head drafted (`_propose_chains`)

        def prepare(width: int) -> None:
            """A batched verify's host work that needs no drafts: pages and, when graphed, its packed indices."""
            _prepare_rows(eng, group, [width] * len(group))
            if eng.graphs is not None:
                seats = list(group) + [None] * (eng.cfg.decode_batch - len(group))
                eng.graphs.prepare_verify(seats, width, getattr(self.drafter, "needs_features", False))
            prepared.append(width)

        trees = self._propose_group(group, speculating, prepare if batched else None)
        roots = [key_token(s.key[s.pos]) for s in group]
        positions = [1 + t.depth for t in trees]
        if batched:   # every node at its own verify position (chains of the head: the prepared width)
            positions = [max([1 + max(len(t) for t in trees)] + prepared)] * len(group)
        if not prepared:
            _prepare_rows(eng, group, positions)
        capture = None
        if getattr(self.drafter, "needs_features", False):
            from k3.rollout.spec.drafter import FeatureCapture
            capture = FeatureCapture(eng.model)
        match = self.cfg.acceptance is Acceptance.MATCH
        emitted: list[list[Emitted]] = [[] for _ in group]
        node = [-1] * len(group)

        def advance(r: int, t: int, logits: torch.Tensor) -> int | None:
            """Row r's acceptance walk at its node of depth t: emit, then the next node's token (None: stop)."""
            s = group[r]
            if not speculating[r]:
                return None
            p = s.req.params
            kids = trees[r].children(node[r])
            e, i = accept_at_node(logits, [trees[r].tokens[c] for c in kids], p, s.gen, match)
            emitted[r].append(e)
            if i is None or e.token in p.stop_token_ids or len(s.out_tokens) + len(emitted[r]) >= p.max_tokens:
                return None   # where plain decoding would stop, the walk stops too
            node[r] = kids[i]
            return e.token

        if batched:
            chains = all(t.is_chain() for t in trees)
            res = verify_batched(eng, group, [[rt] + list(t.tokens) for rt, t in zip(roots, trees)], capture,
                                 None if chains else [t.verify_parents() for t in trees], width=positions[0])
            # the walk over the computed positions (node i at position i + 1), depth by depth: the rows' current
            # logits picked as a decode step picks its rows' last logits (`next_logits`: greedy picks on the
            # device, sampled rows copied to the host; a tree's unwalked nodes never leave the device). Greedy
            # speculating rows have every position picked up front (`_pick_greedy_rows`: one launch, one copy).
            order = [[0] for _ in group]
            live, depth = list(range(len(group))), 0
            _pick_greedy_rows(res, [r for r, s in enumerate(group) if speculating[r] and not s.req.params.temperature])
            while live:
                walked = [r for r in live if not isinstance(res.logits[r][order[r][-1]], NextLogits)]
                if walked:
                    picks = next_logits(torch.stack([res.logits[r][order[r][-1]] for r in walked]),
                                        [group[r].req.params.temperature > 0 for r in walked])
                    for r, picked in zip(walked, picks):
                        res.logits[r][order[r][-1]] = picked
                still = []
                for r in live:
                    if advance(r, depth, res.logits[r][order[r][-1]]) is not None:
                        order[r].append(node[r] + 1)
                        still.append(r)
                live, depth = still, depth + 1
            if not chains:
                keep_path(eng, group, res, order)
        else:
            res = verify_walk(eng, group, roots, positions, advance, capture)
        eng.stats["forwards"] += res.forwards
        n_commit = [len(em) if spec else 1 for em, spec in zip(emitted, speculating)]
        verified = None
        if self.overlap_drafting and eng.device.type == "cuda":   # the next drafts' inputs exist from here on
            verified = torch.cuda.Event()
            verified.record(torch.cuda.current_stream(eng.device))
        side = self._predraft(group, speculating, verified, emitted, res.features, n_commit)
        try:
            commit(eng, group, res.scratch, n_commit)
        finally:   # queued after the commit: the commit runs beside the head, the next verify after both (and a
            if side is not None:   # commit that raises still leaves the streams joined for the next request)
                torch.cuda.current_stream(eng.device).wait_stream(side)
        st = eng.stats
        st["spec_verifies"] += sum(speculating)
        st["spec_draft_tokens"] += sum(len(t) for t in trees)
        st["spec_scratch_bytes_max"] = max(st["spec_scratch_bytes_max"], res.scratch.nbytes())
        for r, (s, em, rt, lg, spec, n) in enumerate(zip(group, emitted, res.routing, res.logits, speculating,
                                                          n_commit)):
            st["computed_tokens"] += len(lg)
            if res.features is not None:   # the last committed position's features draft the next step
                self.features[s] = res.features[r][n - 1]
            s.pos += n
            if not spec:   # as plain decoding continues a fed history token
                eng._after_segment(s, lg[0], rt[0])
                continue
            st["spec_accepted_tokens"] += len(em) - 1
            st["spec_emitted_tokens"] += len(em)
            for j, e in enumerate(em):
                if j == len(em) - 1 and eng.prefix_cache and (
                        s.pos % eng.cfg.checkpoint_interval == 0 or s.pos in s.branch_at):
                    eng._checkpoint(s, None)
                eng._emit(s, e.token, e.logprob, e.sampling_logprob, rt[j])


def _prepare_rows(eng: "Engine", group: list["RunningSeq"], positions: list[int]) -> None:
    """Pages for each row's verify positions (allocated, copied on write), and the rows' pages and states marked
    recently used."""
    for s, n in zip(group, positions):
        eng._prepare_pages(s, n)
        for p in s.bt:
            eng.pages.touch(p)
        eng.states.touch(s.state)


def _to_host(drafts: torch.Tensor) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
    """Device drafts queued for the host: on CUDA a non-blocking copy into pinned memory and the event after it
    (the current stream's), else the tensor itself and None."""
    if not drafts.is_cuda:
        return drafts, None
    host = torch.empty(drafts.shape, dtype=drafts.dtype, pin_memory=True)
    host.copy_(drafts, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(drafts.device))
    return host, event


def _finishes(s: "RunningSeq", emitted: list[Emitted]) -> bool:
    """Row `s` finishes when its step's `emitted` tokens are emitted (engine._emit: a stop token, or its budget)."""
    p = s.req.params
    return emitted[-1].token in p.stop_token_ids or len(s.out_tokens) + len(emitted) >= p.max_tokens


def _pick_greedy_rows(res, rows: list[int]) -> None:
    """The greedy picks of every verify position of `rows` (greedy, speculating rows) in one `next_logits` call:
    one launch and one copy to the host instead of one per depth of the acceptance walk (a row's pick does not
    depend on the rows beside it: the same bits). Their positions' logits become NextLogits in place."""
    if not rows:
        return
    # the batched verify's [rows, T, vocab] block (or the rows' part of it) picked whole: no per-position stacking;
    # the padding positions of shorter drafts are picked too and dropped
    block = res.block
    if rows != list(range(block.shape[0])):
        block = block[torch.tensor(rows, device=block.device)]
    T = block.shape[1]
    flat = next_logits(block.reshape(-1, block.shape[-1]), [False] * (len(rows) * T))
    for i, r in enumerate(rows):
        res.logits[r] = flat[i * T:i * T + len(res.logits[r])]
