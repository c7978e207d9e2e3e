"""The engine's admission: which waiting requests start, what of their prompt the prefix cache already holds,
and the pages and state slot each sample starts from (mixed into `k3.rollout.engine.Engine`)."""
from __future__ import annotations

import math

from k3.rollout.radix import Node, common_prefix
from k3.rollout.sampler import sample_generator
from k3.rollout.sequence import GenRequest, RunningSeq
from k3.rollout.types import Prompt, SamplingParams, key_len, key_token


class Admission:
    def _pages_for(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.cfg.page_size) + 1

    def _need(self, req: GenRequest) -> tuple[int, int]:
        n = req.params.n
        return n * self._pages_for(len(req.key) + req.params.max_tokens), n

    def _check_fits(self, pr: Prompt, sp: SamplingParams, where: str) -> None:
        pages = sp.n * self._pages_for(len(pr) + sp.max_tokens)
        if pages + 1 > self.cfg.device_pages:
            raise ValueError(f"{where}: needs {pages} MLA pages (n={sp.n}, {len(pr)} prompt + {sp.max_tokens} new "
                             f"tokens) but device_pages is {self.cfg.device_pages}")
        if sp.n + 1 > self.cfg.device_states:
            raise ValueError(f"{where}: n={sp.n} samples need {sp.n + 1} KDA state slots, device_states is "
                             f"{self.cfg.device_states}")

    def _admit_waiting(self, waiting: list[GenRequest]) -> None:
        """Admit waiting requests in order while they fit; one held back for a shared prefix that a running
        sequence is computing is passed over, not waited behind (the requests after it, other sessions' calls
        say, start now and prefill beside it)."""
        i = 0
        while i < len(waiting) and self._can_admit(waiting[i]):
            if self._wait_for_shared_prefix(waiting[i]):
                i += 1
            else:
                self._admit(waiting.pop(i))

    def _can_admit(self, req: GenRequest) -> bool:
        """Room for all n samples at full length beside the running ones (one spare slot for checkpoint copies);
        a request that fits the budgets alone is always admitted into an idle engine."""
        if not self.running:
            return True
        pages, states = self._need(req)
        used_pages = sum(self._pages_for(len(s.key) + s.req.params.max_tokens - len(s.out_tokens))
                         for s in self.running)
        return (len(self.running) + req.params.n <= self.cfg.max_running
                and used_pages + pages + 1 <= self.cfg.device_pages
                and len(self.running) + states + 1 <= self.cfg.device_states)

    def _wait_for_shared_prefix(self, req: GenRequest) -> bool:
        """In-batch prefix sharing: when a running sequence of the same scope is still computing a prefix of at
        least `chunk_size` tokens that `req` shares beyond what the cache holds (requests of one call that share a
        system prompt, say), mark that prefix's end for a checkpoint and hold `req` back until it exists; `req` then
        reuses it instead of computing it again. Outputs do not change (the cache is transparent, rows are batch
        invariant); only when requests start does."""
        if not self.prefix_cache:
            return False
        want = self._tree_key(req.key)
        hit = self.tree.match(req.scope, want, touch=False).hit
        for s in self.running:
            if s.req.scope != req.scope:
                continue
            # the last prompt token is always computed by its own request
            n = min(common_prefix(want, self._tree_key(s.key)), len(want) - 1)
            e = self._segment_end_at_or_before(s.key, n)
            if e - hit >= self.cfg.chunk_size and s.pos < e:
                s.branch_at.add(e)
                return True
        return False

    def _tree_key(self, key: list[int]) -> list[int]:
        """What the prefix tree is keyed by: the key itself (exact mode) or its token ids (token mode)."""
        return [key_token(k) for k in key] if self.match_tokens else key

    def _key_resuming_at(self, prompt: Prompt, h: int) -> list[int]:
        """The prompt's key with a segment boundary at `h` (token mode: a hit may end inside one of the prompt's
        prefill chunks; the rest is computed from there, in chunks aligned as usual)."""
        spans, i = [], 0
        for n, kind in prompt.spans:
            spans += [(h - i, kind), (i + n - h, kind)] if i < h < i + n else [(n, kind)]
            i += n
        return Prompt(prompt, spans).key(self.cfg.chunk_size)

    def _admit(self, req: GenRequest) -> None:
        key, L = req.key, len(req.key)
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += L
        node, prefix = None, 0
        if self.prefix_cache:
            m = self.tree.match(req.scope, self._tree_key(key), usable=lambda n: n.end < L or n.extra is not None)
            node, prefix = m.node, m.prefix
        hit = node.end if node is not None else 0
        if self.match_tokens and 0 < hit < L:
            key = self._key_resuming_at(req.prompt, hit)
        req.hit = hit
        self.stats["hit_tokens"] += hit
        self.stats["prefix_tokens"] += prefix
        # tokens this engine computed before (in the tree's path, or by the previous turn) but computes again
        self.stats["recomputed_tokens"] += max(0, max(prefix, req.prompt.parent_len) - hit)
        if req.prompt.parent_len:
            self.stats["resumes"] += 1
            self.stats["resume_recomputed_tokens"] += max(0, req.prompt.parent_len - hit)
        # Order matters for failure isolation: the path's pages are retained first (so nothing the state copy
        # evicts can free them), the sequence joins `running` as soon as it holds a state (an abort then releases
        # all it holds), and pins come last.
        bt = self._path_pages(node) if node is not None else []
        for p in bt:
            self.pages.incref(p)
        try:
            if node is not None:
                state = self.states.copy(node.state)   # copy on write: the tree's checkpoint stays as it was
            else:
                state = self.states.alloc()
                self.states.dev["rec"][self.states.slot(state)].zero_()
                self.states.dev["conv"][self.states.slot(state)].zero_()
        except BaseException:
            for p in bt:
                self.pages.decref(p)
            raise
        seq = RunningSeq(req, 0, list(key), hit, list(bt), state, sample_generator(req.seed, 0), unpinned=set(bt))
        req.samples.append(seq)
        self.running.append(seq)
        for p in bt:
            self.pages.pin(p)
            seq.unpinned.discard(p)
        if self.prefix_cache and hit < prefix < L:
            e = self._segment_end_at_or_before(key, prefix)
            if e > hit:
                seq.branch_at.add(e)  # the prefix forks here: checkpoint it on the way
        if hit == L:  # the whole prompt is cached, with the logits of its last position
            logits, routing, feat = node.extra
            if feat is not None and self.spec is not None:
                self.spec.prompt_features[req] = feat
            self._start_sampling(seq, logits, routing)

    @staticmethod
    def _segment_end_at_or_before(key: list[int], e: int) -> int:
        pos = 0
        while pos + key_len(key[pos]) <= e:
            pos += key_len(key[pos])
            if pos == len(key):
                break
        return pos

    def _path_pages(self, node: Node) -> list[int]:
        path = []
        while node is not None and node.parent is not None:
            path.append(node)
            node = node.parent
        table: list[int] = []
        P = self.cfg.page_size
        for n in reversed(path):
            base = n.start // P
            del table[base:]
            table.extend(n.pages)
            assert len(table) == math.ceil(n.end / P)
        return table

