"""Embedded rollout engine over K3: continuous batching, chunked prefill beside decode, paged MLA latent KV and
KDA state slots with a host tier, and an RL-aware prefix cache (see `radix.py`).

Bitwise reproducibility (cache on == cache off, any batch composition) rests on three rules:
1. Canonical segments: a sequence is always computed in the same pieces. Prefill spans are cut at absolute
   multiples of `chunk_size` and at the span's end; every decode token is fed alone. The sequence key records
   the span structure, so equal keys mean equal computations, and the cache stores states only at segment ends.
2. Prefill chunks run one row per forward ([1, T]); the attention length is padded to a page multiple that
   depends only on the row.
3. Decode steps run with a fixed batch size (`decode_batch`, dummy rows fill empty seats): at a fixed batch size
   a row's result does not depend on its companions or on the padded attention length (the model's linears pad
   their row count, k3.model.ops.linear), while elementwise kernels may still take other paths at another batch
   size. `tests/rollout` checks all of this bitwise.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch

from k3.model import K3ForCausalLM
from k3.rollout.pools import TieredPool
from k3.rollout.radix import Node, RadixTree
from k3.rollout.sampler import sample, sample_generator
from k3.rollout.types import (KIND_DECODE, KIND_PREFILL_END, Completion, Prompt, SamplingParams, key_kind,
                              key_len, key_token, make_key)


@dataclass
class EngineConfig:
    page_size: int = 16            # MLA tokens per page
    chunk_size: int = 64           # prefill chunk (absolute alignment)
    checkpoint_interval: int = 256  # KDA checkpoint every this many tokens (multiple of chunk_size)
    decode_batch: int = 8          # fixed decode batch size (dummy rows fill it)
    max_step_tokens: int = 256     # tokens per engine step (decode rows first, then prefill chunks)
    max_running: int = 32          # running samples
    device_pages: int = 4096
    host_pages: int = 4096
    device_states: int = 64
    host_states: int = 64
    seed: int = 0                  # seeds requests that give none

    def validate(self) -> None:
        for name in ("page_size", "chunk_size", "checkpoint_interval", "decode_batch", "max_step_tokens",
                     "max_running", "device_pages", "device_states"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("host_pages", "host_states"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.checkpoint_interval % self.chunk_size:
            raise ValueError(f"checkpoint_interval: {self.checkpoint_interval} must be a multiple of chunk_size "
                             f"{self.chunk_size} (checkpoints sit at segment ends)")
        if self.max_step_tokens < self.chunk_size:
            raise ValueError(f"max_step_tokens: {self.max_step_tokens} must be >= chunk_size {self.chunk_size}")


@dataclass(eq=False)
class _Request:
    rid: int
    prompt: Prompt
    key: list[int]
    params: SamplingParams
    seed: int
    scope: tuple
    version: int
    samples: list["_Seq"] = field(default_factory=list)
    done: list[Completion | None] = field(default_factory=list)
    hit: int = 0


@dataclass(eq=False)
class _Seq:
    req: _Request
    index: int
    key: list[int]                 # fed key elements [0, pos) + pending ones
    pos: int
    bt: list[int]                  # page ids for positions [0, pos) (+ the page being written)
    state: int
    gen: torch.Generator
    branch_at: set[int] = field(default_factory=set)
    out_tokens: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    out_slogprobs: list[float] = field(default_factory=list)
    out_routing: list[torch.Tensor] = field(default_factory=list)
    sampling: bool = False         # past the prompt: logits at the end of each step are sampled

    @property
    def pending(self) -> int:
        return len(self.key) - self.pos


class _PoolView:
    """CacheView over the engine's pools for one forward: rows (seq or None = dummy seat) at ragged lengths."""

    def __init__(self, eng: "Engine", rows: list[_Seq | None], T: int):
        self.eng, self.rows, self.T = eng, rows, T
        self.past = torch.tensor([0 if r is None else r.pos for r in rows], dtype=torch.long)
        P = eng.cfg.page_size
        self.S = P * math.ceil((int(self.past.max()) + T) / P)
        self.fresh = all(r is None or r.pos == 0 for r in rows)
        dev = eng.device
        real = [(b, r) for b, r in enumerate(rows) if r is not None]
        pos = [(b, r.pos + t) for b, r in real for t in range(T)]
        self.w_rows = torch.tensor([b for b, _ in pos], dtype=torch.long, device=dev)
        self.w_t = torch.tensor([p - rows[b].pos for b, p in pos], dtype=torch.long, device=dev)
        self.w_slot = torch.tensor([eng.pages.slot(rows[b].bt[p // P]) for b, p in pos], dtype=torch.long, device=dev)
        self.w_off = torch.tensor([p % P for _, p in pos], dtype=torch.long, device=dev)
        self.r_idx = [(b, torch.tensor([eng.pages.slot(pg) for pg in r.bt[:math.ceil((r.pos + T) / P)]],
                                        dtype=torch.long, device=dev), r.pos + T) for b, r in real]
        self.s_rows = [b for b, _ in real]
        self.s_slots = torch.tensor([eng.states.slot(r.state) for _, r in real], dtype=torch.long, device=dev)

    def mla(self, layer, c_kv, k_pe):
        eng = self.eng
        li = eng.mla_index[layer]
        store = eng.pages.dev["kv"]
        new = torch.cat([c_kv, k_pe], dim=-1)
        store[self.w_slot, li, self.w_off] = new[self.w_rows, self.w_t].to(store.dtype)
        B, T, D = new.shape
        keys = new.new_zeros(B, self.S, D)
        for b, slots, n in self.r_idx:
            keys[b, :n] = store[slots, li].reshape(-1, D)[:n]
        for b, r in enumerate(self.rows):
            if r is None:
                keys[b, :T] = new[b]
        return keys[..., :c_kv.shape[-1]], keys[..., c_kv.shape[-1]:], self.past.to(c_kv.device)

    def kda(self, layer):
        if self.fresh:
            return None, None
        ki = self.eng.kda_index[layer]
        rec_store, conv_store = self.eng.states.dev["rec"], self.eng.states.dev["conv"]
        B = len(self.rows)
        rec = rec_store.new_zeros(B, *rec_store.shape[2:])
        conv = conv_store.new_zeros(B, *conv_store.shape[2:])
        rec[self.s_rows] = rec_store[self.s_slots, ki]
        conv[self.s_rows] = conv_store[self.s_slots, ki]
        return rec, conv

    def set_kda(self, layer, recurrent, conv):
        ki = self.eng.kda_index[layer]
        self.eng.states.dev["rec"][self.s_slots, ki] = recurrent[self.s_rows].to(torch.float32)
        self.eng.states.dev["conv"][self.s_slots, ki] = conv[self.s_rows].to(self.eng.states.dev["conv"].dtype)


class Engine:
    """`generate(prompts, sampling)` -> one Completion per sample (prompt-major: prompt 0's n samples first).

    prefix_cache=False computes every request from scratch (turn resumes recompute their history with the
    same segments), so its outputs are the bitwise reference for prefix_cache=True."""

    def __init__(self, model: K3ForCausalLM, prefix_cache: bool = True, config: EngineConfig | None = None,
                 version: int = 0, **overrides):
        cfg = config or EngineConfig()
        for k, v in overrides.items():
            if not hasattr(cfg, k):
                raise TypeError(f"Engine: unknown option {k!r}")
            setattr(cfg, k, v)
        cfg.validate()
        self.cfg, self.model, self.prefix_cache, self.version = cfg, model.eval(), prefix_cache, version
        mc = model.config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        layers = range(mc.num_hidden_layers)
        self.mla_index = {l: i for i, l in enumerate(l for l in layers if not mc.is_kda_layer(l))}
        self.kda_index = {l: i for i, l in enumerate(l for l in layers if mc.is_kda_layer(l))}
        D = mc.kv_lora_rank + mc.qk_rope_head_dim
        H, K, W = mc.kda_num_heads, mc.kda_head_dim, mc.conv_kernel_size
        self.pages = TieredPool("mla_pages", {"kv": ((len(self.mla_index), cfg.page_size, D), self.dtype)},
                                cfg.device_pages, cfg.host_pages, self.device)
        self.states = TieredPool("kda_states", {"rec": ((len(self.kda_index), H, K, K), torch.float32),
                                                "conv": ((len(self.kda_index), 3, H * K, W - 1), self.dtype)},
                                 cfg.device_states, cfg.host_states, self.device)
        self.tree = RadixTree(cfg.page_size, retain_pages=lambda ps: [self.pages.incref(x) for x in ps],
                              release_pages=lambda ps: [self.pages.decref(x) for x in ps],
                              release_state=self.states.decref)
        self.pages.reclaimer = lambda tier: self._reclaim(self.pages, tier, leaves_only=True)
        self.states.reclaimer = lambda tier: self._reclaim(self.states, tier, leaves_only=False)
        self._rids = itertools.count()
        self._seeds = torch.Generator().manual_seed(cfg.seed)
        self.running: list[_Seq] = []
        self.check_each_step = False   # tests: verify tree and pool invariants after every step
        self.stats = {"requests": 0, "prompt_tokens": 0, "hit_tokens": 0, "prefix_tokens": 0, "computed_tokens": 0,
                      "recomputed_tokens": 0, "resumes": 0, "resume_recomputed_tokens": 0, "generated_tokens": 0,
                      "checkpoints": 0, "forwards": 0}

    # ------------------------------------------------------------------ public API
    def generate(self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[Completion]:
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts: expected a non-empty list of token-id lists")
        params = sampling if isinstance(sampling, list) else [sampling or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling: {len(params)} SamplingParams for {len(prompts)} prompts")
        vocab = self.model.config.vocab_size
        reqs = []
        for i, (pr, sp) in enumerate(zip(prompts, params)):
            sp.validate()
            pr = pr if isinstance(pr, Prompt) else Prompt(pr)
            pr.validate(vocab, f"prompts[{i}]")
            bad = [t for t in sp.stop_token_ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"sampling.stop_token_ids: {bad} outside [0, {vocab})")
            self._check_fits(pr, sp, f"prompts[{i}]")
            seed = sp.seed if sp.seed is not None else int(torch.randint(0, 1 << 62, (1,), generator=self._seeds))
            reqs.append(_Request(next(self._rids), pr, pr.key(self.cfg.chunk_size), sp, seed, (sp.adapter_id, self.version),
                                 self.version, done=[None] * sp.n))
        waiting = list(reqs)
        with torch.inference_mode():
            while waiting or self.running:
                while waiting and self._can_admit(waiting[0]):
                    self._admit(waiting.pop(0))
                if not self.running:
                    raise RuntimeError("engine: cannot admit the next request within the pool budgets")
                self._step()
                if self.check_each_step:
                    self.check()
        return [c for r in reqs for c in r.done]

    def update_weights(self, state_dict: dict[str, torch.Tensor] | None, version: int) -> None:
        """Load `state_dict` (None: the weights were already updated in place, e.g. by a k3.sync WeightReceiver
        built on this model's tensors) and move to `version`; cache entries of older versions are released."""
        if not isinstance(version, int):
            raise ValueError(f"version: expected an int, got {version!r}")
        if self.running:
            raise RuntimeError("update_weights: requests are running")
        if state_dict is not None:
            own = self.model.state_dict()
            unknown = sorted(set(state_dict) - set(own))
            if unknown:
                raise ValueError(f"state_dict: unknown parameters {unknown[:5]}")
            for k, v in state_dict.items():
                if tuple(v.shape) != tuple(own[k].shape):
                    raise ValueError(f"state_dict: {k} has shape {tuple(v.shape)}, model has {tuple(own[k].shape)}")
            with torch.no_grad():
                for k, v in state_dict.items():
                    own[k].copy_(v)
        self.version = version
        for scope in [s for s in self.tree.roots if s[1] != version]:
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

    # ------------------------------------------------------------------ admission
    def _pages_for(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.cfg.page_size) + 1

    def _need(self, req: _Request) -> tuple[int, int]:
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

    def _can_admit(self, req: _Request) -> bool:
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

    def _admit(self, req: _Request) -> None:
        key, L = req.key, len(req.key)
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += L
        node, prefix = None, 0
        if self.prefix_cache:
            m = self.tree.match(req.scope, key, usable=lambda n: n.end < L or n.extra is not None)
            node, prefix = m.node, m.prefix
        hit = node.end if node is not None else 0
        req.hit = hit
        self.stats["hit_tokens"] += hit
        self.stats["prefix_tokens"] += prefix
        # tokens this engine computed before (in the tree's path, or by the previous turn) but computes again
        self.stats["recomputed_tokens"] += max(0, max(prefix, req.prompt.parent_len) - hit)
        if req.prompt.parent_len:
            self.stats["resumes"] += 1
            self.stats["resume_recomputed_tokens"] += max(0, req.prompt.parent_len - hit)
        bt: list[int] = []
        if node is not None:
            bt = self._path_pages(node)
            for p in bt:
                self.pages.incref(p)
                self.pages.pin(p)
            state = self.states.copy(node.state)   # copy on write: the tree's checkpoint stays as it was
        else:
            state = self.states.alloc()
            self.states.dev["rec"][self.states.slot(state)].zero_()
            self.states.dev["conv"][self.states.slot(state)].zero_()
        seq = _Seq(req, 0, list(key), hit, bt, state, sample_generator(req.seed, 0))
        req.samples.append(seq)
        if self.prefix_cache and hit < prefix < L:
            e = self._segment_end_at_or_before(key, prefix)
            if e > hit:
                seq.branch_at.add(e)  # the prefix forks here: checkpoint it on the way
        self.running.append(seq)
        if hit == L:  # the whole prompt is cached, with the logits of its last position
            logits, routing = node.extra
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

    # ------------------------------------------------------------------ stepping
    @staticmethod
    def _next_segment(s: _Seq) -> int:
        """Tokens in `s`'s next segment (1 for a decode token), as recorded in its key."""
        return key_len(s.key[s.pos])

    def _step(self) -> None:
        active = [s for s in self.running if s.pending > 0]
        decode = [s for s in active if key_kind(s.key[s.pos]) == KIND_DECODE]
        budget = self.cfg.max_step_tokens - len(decode)
        prefill: list[tuple[_Seq, int]] = []
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
            self._forward(group + [None] * (B - len(group)), 1)
        for s, t in prefill:
            self._forward([s], t)

    def _prepare_pages(self, s: _Seq, T: int) -> None:
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

    def _forward(self, rows: list[_Seq | None], T: int) -> None:
        real = [r for r in rows if r is not None]
        for s in real:
            self._prepare_pages(s, T)
        for s in real:  # recency for the LRU eviction
            for p in s.bt:
                self.pages.touch(p)
            self.states.touch(s.state)
        ids = torch.tensor([[0] * T if r is None else [key_token(k) for k in r.key[r.pos:r.pos + T]] for r in rows],
                           dtype=torch.long, device=self.device)
        view = _PoolView(self, rows, T)
        out = self.model(ids, view, return_routed_experts=True)
        self.stats["forwards"] += 1
        routed = out.routed_experts
        for b, s in enumerate(rows):
            if s is None:
                continue
            s.pos += T
            self.stats["computed_tokens"] += T
            logits = out.logits[b, -1]
            routing = routed[b, -1] if routed is not None else torch.zeros(0, 0, dtype=torch.long)
            self._after_segment(s, logits, routing)

    def _after_segment(self, s: _Seq, logits: torch.Tensor, routing: torch.Tensor) -> None:
        last_kind = key_kind(s.key[s.pos - 1])
        if self.prefix_cache:
            prompt_end = last_kind == KIND_PREFILL_END
            if prompt_end or s.pos % self.cfg.checkpoint_interval == 0 or s.pos in s.branch_at:
                extra = (logits.detach().clone(), routing.detach().clone()) if prompt_end else None
                self._checkpoint(s, extra)
        if s.pending == 0:
            if not s.sampling:
                self._start_sampling(s, logits, routing)
            else:
                self._sample_next(s, logits, routing)

    def _checkpoint(self, s: _Seq, extra) -> None:
        ck = self.states.copy(s.state)
        self.states.unpin(ck)
        self.tree.insert(s.req.scope, s.key[:s.pos], s.bt, state=ck, extra=extra)
        self.stats["checkpoints"] += 1

    def _start_sampling(self, s: _Seq, logits: torch.Tensor, routing: torch.Tensor) -> None:
        """The prompt is done: fork the n samples here (they share the prompt's pages; copy its state)."""
        s.sampling = True
        req = s.req
        for i in range(1, req.params.n):
            for p in s.bt:
                self.pages.incref(p)
                self.pages.pin(p)
            sib = _Seq(req, i, list(s.key), s.pos, list(s.bt), self.states.copy(s.state),
                       sample_generator(req.seed, i), sampling=True)
            req.samples.append(sib)
            self.running.append(sib)
        for sib in list(req.samples):
            if sib.sampling and not sib.out_tokens:
                self._sample_next(sib, logits, routing)

    def _sample_next(self, s: _Seq, logits: torch.Tensor, routing: torch.Tensor) -> None:
        p = s.req.params
        tok, lp, slp = sample(logits, p, s.gen)
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

    def _finish(self, s: _Seq, reason: str) -> None:
        req = s.req
        self.running.remove(s)
        self.states.unpin(s.state)
        for p in s.bt:
            self.pages.unpin(p)
        if self.prefix_cache and s.pos > 0:
            # turn end: state after the last fed token (the last sampled token opens the next turn's prefill)
            self.tree.insert(req.scope, s.key[:s.pos], s.bt, state=s.state)
            self.stats["checkpoints"] += 1
        else:
            self.states.decref(s.state)
        for p in s.bt:
            self.pages.decref(p)
        routing = torch.stack(s.out_routing) if s.out_routing else torch.zeros(0, 0, 0, dtype=torch.int32)
        req.done[s.index] = Completion(req.prompt, s.out_tokens, s.out_logprobs, s.out_slogprobs, routing, reason,
                                       req.version, req.params.adapter_id, s.index, req.rid, req.hit)

    # ------------------------------------------------------------------ eviction
    def _reclaim(self, pool: TieredPool, tier: str, leaves_only: bool) -> bool:
        """Drop the LRU tree holder of an unpinned `pool` item on `tier`: for states any checkpoint (its node
        stays as a path unless it is a leaf), for pages a leaf (state first, then its pages)."""
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
            node = self.tree.lru(holds)
            if node is None:
                return False
            self.tree.drop_state(node)
        return True
