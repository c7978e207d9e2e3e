"""Embedded rollout engine over K3: continuous batching, chunked prefill beside decode, paged MLA latent KV and
KDA state slots with a host tier, and an RL-aware prefix cache (see `radix.py`).

Bitwise reproducibility (cache on == cache off, any batch composition) rests on three rules:
1. Canonical segments: a sequence is always computed in the same pieces. Prefill spans are cut at absolute
   multiples of `chunk_size` and at the span's end; every decode token is fed alone. The sequence key records
   the span structure, so equal keys mean equal computations, and the cache stores states only at segment ends.
2. Prefill chunks run one row per forward ([1, T]), or with `prefill_batch` > 1 in forwards of that many rows
   (dummy rows fill it) that hold only segments at the same position and length; the attention length is padded
   to a page multiple that depends only on the row. Either way a segment's shapes are its own.
3. Decode steps run with a fixed batch size (`decode_batch`, dummy rows fill empty seats): at a fixed batch size
   a row's result does not depend on its companions or on the padded attention length (on CPU the model's
   linears multiply fixed-size row blocks and MLA attends row by row, k3.model.ops), while elementwise kernels
   may still take other paths at another batch size. `tests/rollout` checks all of this bitwise.
Token-keyed matching (`prefix_match="tokens"`, see `PrefixMatch`) trades rule 1 for reuse of flat histories.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math

import torch

from k3.model import K3ForCausalLM
from k3.rollout.admission import Admission
from k3.rollout.config import EngineConfig, PrefixMatch, RequestFailed
from k3.rollout.graphs import DecodeGraphs
from k3.rollout.pools import TieredPool
from k3.rollout.radix import Node, RadixTree
from k3.rollout.sampler import NextLogits, next_logits, sample, sample_generator
from k3.rollout.spec.decode import SpecDecoder
from k3.rollout.sequence import GenRequest, RunningSeq
from k3.rollout.types import (KIND_DECODE, KIND_PREFILL_END, Completion, SamplingParams, checked_requests,
                              key_kind, key_len, key_token, make_key)
from k3.rollout.view import PoolView


class Engine(Admission):
    """`generate(prompts, sampling)` -> one Completion per sample (prompt-major: prompt 0's n samples first).

    prefix_cache=False computes every request from scratch (turn resumes recompute their history with the
    same segments), so its outputs are the bitwise reference for prefix_cache=True.

    Multi-LoRA: when the model carries a `k3.lora.LoRAManager`, each request's `adapter_id` selects its adapter
    (None = the base model) row by row, in prefill and in mixed decode batches alike; cache entries are scoped by
    (adapter id, policy version). Adapter ids the manager does not hold are refused before admission.

    Failures: every request is checked before any is admitted (types, finiteness, ranges, vocabulary, prompt length
    against `max_position_embeddings`, pool budgets, adapter ids). An exception after admission finishes and
    releases every sequence of that call, restores the request-seed counter, and raises `RequestFailed`."""

    def __init__(self, model: K3ForCausalLM, prefix_cache: bool = True, config: EngineConfig | None = None,
                 version: int = 0, **overrides):
        cfg = config or EngineConfig()
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        for k in overrides:
            if k not in known:
                raise TypeError(f"Engine: unknown option {k!r}")
        cfg = dataclasses.replace(cfg, **overrides)
        cfg.validate()
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version: expected an int >= 0, got {version!r}")
        self.cfg, self.model, self.prefix_cache, self.version = cfg, model.eval(), prefix_cache, version
        self.match_tokens = cfg.prefix_match is PrefixMatch.TOKENS
        mc = model.config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        layers = range(mc.num_hidden_layers)
        self.mla_index = {l: i for i, l in enumerate(l for l in layers if not mc.is_kda_layer(l))}
        self.kda_index = {l: i for i, l in enumerate(l for l in layers if mc.is_kda_layer(l))}
        D = mc.kv_lora_rank + mc.qk_rope_head_dim
        H, K, W = mc.kda_num_heads, mc.kda_head_dim, mc.conv_kernel_size
        self.pages = TieredPool("mla_pages", {"kv": ((len(self.mla_index), cfg.page_size, D), self.dtype)},
                                cfg.device_pages, cfg.host_pages, self.device, spare=1)
        self.states = TieredPool("kda_states", {"rec": ((len(self.kda_index), H, K, K), torch.float32),
                                                "conv": ((len(self.kda_index), 3, H * K, W - 1), self.dtype)},
                                 cfg.device_states, cfg.host_states, self.device, spare=1)
        self.tree = RadixTree(cfg.page_size, retain_pages=lambda ps: [self.pages.incref(x) for x in ps],
                              release_pages=lambda ps: [self.pages.decref(x) for x in ps],
                              release_state=self.states.decref)
        self.pages.reclaimer = lambda tier: self._reclaim(self.pages, tier, leaves_only=True)
        self.states.reclaimer = lambda tier: self._reclaim(self.states, tier, leaves_only=False)
        self._rids = itertools.count()
        self._seeds = torch.Generator().manual_seed(cfg.seed)
        self.running: list[RunningSeq] = []
        self.check_each_step = False   # tests: verify tree and pool invariants after every step
        self.stats = {"requests": 0, "prompt_tokens": 0, "hit_tokens": 0, "prefix_tokens": 0, "computed_tokens": 0,
                      "recomputed_tokens": 0, "resumes": 0, "resume_recomputed_tokens": 0, "generated_tokens": 0,
                      "checkpoints": 0, "forwards": 0, "failed_calls": 0}
        # decode steps, chain verifies and their commits as CUDA graphs (k3.rollout.graphs); eager on CPU
        self.graphs = DecodeGraphs(self) if cfg.cuda_graphs and self.device.type == "cuda" else None
        self.spec = None if cfg.speculative is None else SpecDecoder(self, cfg.speculative)

    @property
    def lora(self):
        """The model's LoRAManager (k3.lora), or None: the engine then serves the base model only."""
        return getattr(self.model, "_lora_manager", None)

    # ------------------------------------------------------------------ public API
    def generate(self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[Completion]:
        if self.running:
            raise RuntimeError(f"generate: {len(self.running)} sequences of another call are running (one call "
                               f"at a time)")
        reqs = self._requests(prompts, sampling)
        seeds_before = self._seeds.get_state()
        for r in reqs:   # seeds are drawn only once every request passed its checks
            r.seed = r.params.seed if r.params.seed is not None else int(
                torch.randint(0, 1 << 62, (1,), generator=self._seeds))
        waiting = list(reqs)
        try:
            with torch.inference_mode():
                while waiting or self.running:
                    self._admit_waiting(waiting)
                    if not self.running:
                        raise RuntimeError("engine: cannot admit the next request within the pool budgets")
                    self._step()
                    if self.check_each_step:
                        self.check()
        except BaseException as e:
            self._abort()
            self._seeds.set_state(seeds_before)
            self.stats["failed_calls"] += 1
            if not isinstance(e, Exception):   # KeyboardInterrupt and the like pass through as they are
                raise
            raise RequestFailed(f"generate: failed after admission ({type(e).__name__}: {e}); the call's "
                                f"{sum(len(r.samples) for r in reqs)} sequences were released") from e
        return [c for r in reqs for c in r.done]

    def _requests(self, prompts, sampling) -> list[GenRequest]:
        """Every request checked and keyed, before any is admitted: a bad one fails the call with nothing done."""
        mc = self.model.config
        reqs = []
        for pr, sp, where in checked_requests(prompts, sampling, vocab_size=mc.vocab_size,
                                              max_len=mc.max_position_embeddings,
                                              limit="the model's max_position_embeddings",
                                              check_adapter=self._check_adapter):
            self._check_fits(pr, sp, where)
            reqs.append(GenRequest(next(self._rids), pr, pr.key(self.cfg.chunk_size), sp, 0,
                                 (sp.adapter_id, self.version), self.version, done=[None] * sp.n))
        return reqs

    def _check_adapter(self, adapter_id: str | None, where: str) -> None:
        lora = self.lora
        if lora is not None and lora.merged is not None:
            if adapter_id != lora.merged:
                raise ValueError(f"{where}: adapter {lora.merged!r} is merged into the served weights, so every "
                                 f"request must name it; got {adapter_id!r}")
            return
        if adapter_id is None:
            return
        if lora is None:
            raise ValueError(f"{where}: unknown adapter {adapter_id!r}: the model has no LoRAManager (no adapters)")
        if adapter_id not in lora.adapters:
            raise ValueError(f"{where}: unknown adapter {adapter_id!r} (loaded: {sorted(lora.adapters)})")

    def _abort(self) -> None:
        """Finish every running sequence of the failed call without a result: release its pages and state
        (nothing it computed is inserted into the cache); what the cache already holds stays valid."""
        for s in list(self.running):
            self.running.remove(s)
            self.states.unpin(s.state)
            self.states.decref(s.state)
            for p in s.bt:
                if p not in s.unpinned:
                    self.pages.unpin(p)
                self.pages.decref(p)

    def update_weights(self, state_dict: dict[str, torch.Tensor] | None, version: int) -> None:
        """Load `state_dict` (None: the weights were already updated in place, e.g. by a k3.sync WeightReceiver
        built on this model's tensors) and move to `version`, which must be newer than the current one (a policy
        version names one set of weights: reusing or rewinding it would serve stale cache entries); cache entries
        of older versions are released. Everything is checked before any weight is written."""
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"version: expected an int, got {version!r}")
        if version <= self.version:
            raise ValueError(f"version: {version} is not newer than the engine's version {self.version}")
        if self.running:
            raise RuntimeError("update_weights: requests are running")
        if state_dict is not None:
            own = self.model.state_dict()
            unknown = sorted(set(state_dict) - set(own))
            if unknown:
                raise ValueError(f"state_dict: unknown parameters {unknown[:5]}")
            for k, v in state_dict.items():
                if not isinstance(v, torch.Tensor):
                    raise ValueError(f"state_dict: {k} is a {type(v).__name__}, not a tensor")
                if tuple(v.shape) != tuple(own[k].shape):
                    raise ValueError(f"state_dict: {k} has shape {tuple(v.shape)}, model has {tuple(own[k].shape)}")
                if v.is_floating_point() != own[k].is_floating_point():
                    raise ValueError(f"state_dict: {k} has dtype {v.dtype}, model has {own[k].dtype}")
                if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                    raise ValueError(f"state_dict: {k} has non-finite values")
            with torch.no_grad():
                for k, v in state_dict.items():
                    own[k].copy_(v)
        self.version = version
        for scope in [s for s in self.tree.roots if s[1] != version]:
            self.tree.drop_scope(scope)

    def adapter_updated(self, adapter_id: str) -> None:
        """An adapter's weights changed in place (hot-load) without a policy-version bump: release its cache
        entries, so nothing computed with the old weights is served."""
        if self.running:
            raise RuntimeError("adapter_updated: requests are running")
        for scope in [s for s in self.tree.roots if s[0] == adapter_id]:
            self.tree.drop_scope(scope)

    def apply_weight_payload(self, receiver, payload) -> int:
        """Apply a k3.sync payload through `receiver` (built on this model's state_dict tensors) and bump."""
        version = receiver.apply(payload)
        self.update_weights(None, version)
        return version

    def cache_stats(self) -> dict:
        s = dict(self.stats)
        s["hit_rate"] = s["hit_tokens"] / s["prompt_tokens"] if s["prompt_tokens"] else 0.0
        nodes = list(self.tree.nodes())
        s["tree_nodes"] = len(nodes)
        s["tree_states"] = sum(n.state is not None for n in nodes)
        for pool in (self.pages, self.states):
            s[f"{pool.name}_device"] = pool.used("device")
            s[f"{pool.name}_host"] = pool.used("host")
            s[f"{pool.name}_spills"] = pool.stats["spills"]
            s[f"{pool.name}_restores"] = pool.stats["restores"]
        s["state_bytes"] = self.states.item_bytes
        s["page_bytes"] = self.pages.item_bytes
        s.update({f"tree_{k}": v for k, v in self.tree.stats.items()})
        return s

    def check(self) -> None:
        """Tree and pool invariants, and reference counts equal to the holders (tree + running samples)."""
        self.tree.check()
        self.pages.check()
        self.states.check()
        page_refs: dict[int, int] = {}
        state_refs: dict[int, int] = {}
        for n in self.tree.nodes():
            for p in n.pages:
                page_refs[p] = page_refs.get(p, 0) + 1
            if n.state is not None:
                state_refs[n.state] = state_refs.get(n.state, 0) + 1
        for s in self.running:
            for p in s.bt:
                page_refs[p] = page_refs.get(p, 0) + 1
            state_refs[s.state] = state_refs.get(s.state, 0) + 1
        for pool, refs in ((self.pages, page_refs), (self.states, state_refs)):
            held = {i: it.ref for i, it in pool.items.items()}
            assert held == refs, f"{pool.name}: refcounts {held} differ from holders {refs}"
        for s in self.running:
            for p in s.bt:
                assert self.pages.items[p].tier == "device", "a running sample's page is not on the device"

    # ------------------------------------------------------------------ stepping
    @staticmethod
    def _next_segment(s: RunningSeq) -> int:
        """Tokens in `s`'s next segment (1 for a decode token), as recorded in its key."""
        return key_len(s.key[s.pos])

    def _step(self) -> None:
        active = [s for s in self.running if s.pending > 0]
        decode = [s for s in active if key_kind(s.key[s.pos]) == KIND_DECODE]
        budget = self.cfg.max_step_tokens - len(decode)
        prefill: list[tuple[RunningSeq, int]] = []
        for s in active:
            if key_kind(s.key[s.pos]) == KIND_DECODE:
                continue
            t = self._next_segment(s)
            if t > budget and (prefill or decode):
                break
            prefill.append((s, t))
            budget -= t
        B = self.cfg.decode_batch
        for i in range(0, len(decode), B):
            group = decode[i:i + B]
            if self.spec is not None:   # speculative decoding: draft, verify, ReplaySSM commit (k3.rollout.spec)
                self.spec.step(group)
            else:
                self._forward(group + [None] * (B - len(group)), 1)
        P = self.cfg.prefill_batch
        if P == 1:
            for s, t in prefill:
                self._forward([s], t)
            return
        # segments at the same (position, length) share forwards of P rows: the attention length and the KDA
        # state's presence follow from the position, so each row's shapes are those it would have alone
        same_place: dict[tuple[int, int], list[RunningSeq]] = {}
        for s, t in prefill:
            same_place.setdefault((s.pos, t), []).append(s)
        for (_, t), seqs in same_place.items():
            for i in range(0, len(seqs), P):
                group = seqs[i:i + P]
                self._forward(group + [None] * (P - len(group)), t)

    def _prepare_pages(self, s: RunningSeq, T: int) -> None:
        """Pages for positions [pos, pos+T): allocated if missing, copied if shared (copy on write)."""
        P = self.cfg.page_size
        for j in range(s.pos // P, math.ceil((s.pos + T) / P)):
            if j == len(s.bt):
                s.bt.append(self.pages.alloc())
            elif self.pages.items[s.bt[j]].ref > 1:
                old = s.bt[j]
                s.bt[j] = self.pages.copy(old)
                self.pages.unpin(old)
                self.pages.decref(old)

    def _forward(self, rows: list[RunningSeq | None], T: int) -> None:
        real = [r for r in rows if r is not None]
        for s in real:
            self._prepare_pages(s, T)
        for s in real:  # recency for the LRU eviction
            for p in s.bt:
                self.pages.touch(p)
            self.states.touch(s.state)
        capture = self.spec.prefill_capture(rows, T) if self.spec is not None else None
        if capture is None and self.graphs is not None and self.graphs.accepts(rows, T):
            out = self.graphs.forward(rows, T)   # a decode step: replay of its captured forward
        else:
            ids = torch.tensor([[0] * T if r is None else [key_token(k) for k in r.key[r.pos:r.pos + T]]
                                for r in rows], dtype=torch.long, device=self.device)
            view = PoolView(self, rows, T)
            with self._adapters_for(rows), capture or contextlib.nullcontext():
                out = self.model(ids, view, return_routed_experts=True, check_ids=False)   # ids checked on the host
        self.stats["forwards"] += 1
        if capture is not None:   # the trained drafter's features of the prompts ending here
            self.spec.keep_prompt_features(rows, T, capture)
        # the last position's logits: on CUDA each row's greedy pick on the device (one launch) and a host copy of
        # the sampled rows only, in one copy; the routed experts in one copy (one copy and sync per row made a
        # decode step's host time grow with its rows on CUDA)
        logits = next_logits(out.logits[:, -1], [r is not None and r.req.params.temperature > 0 for r in rows])
        routed = out.routed_experts
        routing = (routed[:, -1].to(torch.int32).cpu() if routed is not None
                   else torch.zeros(len(rows), 0, 0, dtype=torch.int32))
        for b, s in enumerate(rows):
            if s is None:
                continue
            s.pos += T
            self.stats["computed_tokens"] += T
            self._after_segment(s, logits[b], routing[b])

    def _adapters_for(self, rows: list[RunningSeq | None]):
        """Each row's own adapter (dummy seats: the base) for one forward; the base alone when no row has one."""
        lora = self.lora
        if lora is None or lora.merged is not None:   # the served weights are the whole model
            return contextlib.nullcontext()
        names = [None if r is None else r.req.params.adapter_id for r in rows]
        return lora.use(names if any(names) else None)

    def _after_segment(self, s: RunningSeq, logits: NextLogits, routing: torch.Tensor) -> None:
        last_kind = key_kind(s.key[s.pos - 1])
        if self.prefix_cache:
            prompt_end = last_kind == KIND_PREFILL_END
            if prompt_end or s.pos % self.cfg.checkpoint_interval == 0 or s.pos in s.branch_at:
                extra = None
                if prompt_end:   # a hit on the whole prompt samples from these (and drafts from the features)
                    feat = self.spec.prompt_features.get(s.req) if self.spec is not None else None
                    extra = (logits.clone(), routing.detach().clone(), feat)
                self._checkpoint(s, extra)
        if s.pending == 0:
            if not s.sampling:
                self._start_sampling(s, logits, routing)
            else:
                self._sample_next(s, logits, routing)

    def _checkpoint(self, s: RunningSeq, extra) -> None:
        ck = self.states.copy(s.state)
        self.states.unpin(ck)
        try:
            self.tree.insert(s.req.scope, self._tree_key(s.key[:s.pos]), s.bt, state=ck, extra=extra)
        except BaseException:
            self.states.decref(ck)
            raise
        self.stats["checkpoints"] += 1

    def _start_sampling(self, s: RunningSeq, logits: NextLogits, routing: torch.Tensor) -> None:
        """The prompt is done: fork the n samples here (they share the prompt's pages; copy its state)."""
        s.sampling = True
        req = s.req
        for i in range(1, req.params.n):
            state = self.states.copy(s.state)   # first: if it fails, the sibling holds nothing yet
            for p in s.bt:
                self.pages.incref(p)
            sib = RunningSeq(req, i, list(s.key), s.pos, list(s.bt), state, sample_generator(req.seed, i),
                             sampling=True, unpinned=set(s.bt))
            req.samples.append(sib)
            self.running.append(sib)
            for p in s.bt:
                self.pages.pin(p)
                sib.unpinned.discard(p)
        for sib in list(req.samples):
            if sib.sampling and not sib.out_tokens:
                self._sample_next(sib, logits, routing)

    def _sample_next(self, s: RunningSeq, logits: NextLogits, routing: torch.Tensor) -> None:
        tok, lp, slp = sample(logits, s.req.params, s.gen)
        self._emit(s, tok, lp, slp, routing)

    def _emit(self, s: RunningSeq, tok: int, lp: float, slp: float, routing: torch.Tensor) -> None:
        """Append a produced token (sampled, or accepted by speculative verification) and finish on stop/length."""
        p = s.req.params
        s.out_tokens.append(tok)
        s.out_logprobs.append(lp)
        s.out_slogprobs.append(slp)
        s.out_routing.append(routing.to(torch.int32).cpu())
        self.stats["generated_tokens"] += 1
        if tok in p.stop_token_ids:
            self._finish(s, "stop")
        elif len(s.out_tokens) >= p.max_tokens:
            self._finish(s, "length")
        else:
            s.key.append(make_key(tok, 1, KIND_DECODE))

    def _finish(self, s: RunningSeq, reason: str) -> None:
        req = s.req
        self.running.remove(s)
        self.states.unpin(s.state)
        for p in s.bt:
            self.pages.unpin(p)
        handed_over = False   # the state passes to the tree; released here if the insert fails
        try:
            if self.prefix_cache and s.pos > 0:
                # turn end: state after the last fed token (the last sampled token opens the next turn's prefill)
                self.tree.insert(req.scope, self._tree_key(s.key[:s.pos]), s.bt, state=s.state)
                handed_over = True
                self.stats["checkpoints"] += 1
        finally:
            if not handed_over:
                self.states.decref(s.state)
            for p in s.bt:
                self.pages.decref(p)
        routing = torch.stack(s.out_routing) if s.out_routing else torch.zeros(0, 0, 0, dtype=torch.int32)
        req.done[s.index] = Completion(req.prompt, s.out_tokens, s.out_logprobs, s.out_slogprobs, routing, reason,
                                       req.version, req.params.adapter_id, s.index, req.rid, req.hit)

    # ------------------------------------------------------------------ eviction
    def _reclaim(self, pool: TieredPool, tier: str, leaves_only: bool) -> bool:
        """Drop the LRU tree holder of an unpinned `pool` item on `tier`: for states a checkpoint, interior nodes
        before leaves (its node stays as a path unless it is a leaf), for pages a leaf (state first, then pages)."""
        def holds(n: Node) -> bool:
            items = n.pages if pool is self.pages else ([n.state] if n.state is not None else [])
            return any(pool.items[i].tier == tier and pool.items[i].pin == 0 and pool.items[i].ref == 1
                       for i in items)
        if leaves_only:
            node = self.tree.lru(lambda n: not n.children and holds(n))
            if node is None:
                return False
            self.tree.evict_leaf(node)
        else:
            # interior checkpoints first: a request continuing below one hits the deeper state anyway, while a
            # leaf (a turn end) is what the next turn resumes from (benchmarks/prefix_cache.py, equal memory)
            node = self.tree.lru(lambda n: bool(n.children) and holds(n)) or self.tree.lru(holds)
            if node is None:
                return False
            self.tree.drop_state(node)
        return True
