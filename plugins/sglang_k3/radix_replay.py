"""Replay request traces through a real SGLang radix cache (SGLang's `UnifiedRadixCache` or ours) on the pools of
SGLang's own unit-test kit (`sglang.test.kits.unified_radix_cache`, `build_fixture`), the way the scheduler drives
it: match the prompt, take the matched KV into the request's row, allocate the rest (evicting when a pool is full),
checkpoint the prompt (`cache_unfinished_req`), append the generated tokens, finish (`cache_finished_req`: the
turn-end checkpoint), free the row. No model runs: the figures are the cache's decisions (hit tokens), at the
pool sizes given (equal KV and state memory for both classes).

`build_cache(cfg, backend)` builds the kit's fixture with its class replaced through SGLang's real selection path
(`register_radix_cache_backend` + `--radix-cache-backend` + `create_tree_cache`) when backend is "k3".
"""
from __future__ import annotations

import functools
from array import array
from dataclasses import dataclass, field
from unittest import mock

BACKENDS = ("sglang", "k3")


def _via_registry(params):
    """Stands in for the kit's `UnifiedRadixCache(params=...)`: SGLang's `create_tree_cache` with the context a
    scheduler builds; the published server args carry `--radix-cache-backend k3` (see `build_cache`)."""
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.runtime_context import get_server_args

    comps = tuple(params.tree_components)
    ctx = TreeCacheBuildContext(
        server_args=get_server_args(), params=params, is_hybrid_swa=ComponentType.SWA in comps,
        is_hybrid_ssm=ComponentType.MAMBA in comps, enable_hierarchical_cache=False, disable_radix_cache=False,
        tp_worker=None, model_config=None, tp_size=1, tp_rank=0, tp_group=None, full_tokens_per_layer=None)
    return create_tree_cache(ctx)


def build_cache(cfg, backend: str, **fixture_kwargs):
    """(cache, allocator, req_to_token_pool) from the kit's `build_fixture(cfg)`; backend "k3" swaps the class."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} is not one of {BACKENDS}")
    from sglang.test.kits.unified_radix_cache import fixtures

    if backend == "sglang":
        return fixtures.build_fixture(cfg, **fixture_kwargs)
    from k3_sglang.radix_cache import BACKEND, register

    register()
    server_args = functools.partial(fixtures.ServerArgs, radix_cache_backend=BACKEND)
    with mock.patch.object(fixtures, "UnifiedRadixCache", _via_registry), \
            mock.patch.object(fixtures, "ServerArgs", server_args):
        return fixtures.build_fixture(cfg, **fixture_kwargs)


@dataclass
class ReplayStats:
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    resume_requests: int = 0
    resume_tokens: int = 0           # tokens a resumed turn had computed before (its previous turn's length)
    resume_recomputed: int = 0       # of those, tokens recomputed
    evictions: int = 0
    hits: list[int] = field(default_factory=list)

    def summary(self) -> dict:
        return {"requests": self.requests, "prompt_tokens": self.prompt_tokens, "hit_tokens": self.hit_tokens,
                "hit_rate": self.hit_tokens / max(1, self.prompt_tokens), "resume_tokens": self.resume_tokens,
                "resume_recomputed_tokens": self.resume_recomputed, "evict_calls": self.evictions}


class CacheDriver:
    """One cache on the kit's pools, served one request at a time (see the module doc)."""

    def __init__(self, cfg, backend: str, verify_prefix: bool = False):
        """`verify_prefix`: write each computed token's id into its KV slot (first layer, first element; ids must
        be < 256 to be exact in bf16) and check every hit's KV slots hold the matched tokens' ids."""
        self.cfg, self.verify_prefix = cfg, verify_prefix
        self.cache, self.allocator, self.pool = build_cache(cfg, backend)
        self.stats = ReplayStats()
        self._rid = 0
        self.base_version, self.versions = 0, {}

    # -------------------------------------------------------------- pools
    def _evict(self, tokens: int = 0, mamba: int = 0) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self.stats.evictions += 1
        self.cache.evict(EvictParams(num_tokens=tokens, mamba_num=mamba))

    def _alloc_kv(self, n: int):
        if n == 0:
            import torch
            return torch.empty(0, dtype=torch.int64)
        ps = self.cfg.page_size
        need = -(-n // ps) * ps
        if self.allocator.available_size() < need:
            self._evict(tokens=need - self.allocator.available_size())
        from sglang.test.kits.unified_radix_cache.mixins import UnifiedRadixCacheFixtures

        out = UnifiedRadixCacheFixtures._alloc(self, self.allocator, n)   # the kit's (paged SWA needs its path)
        if out is None:
            raise RuntimeError(f"kv pool: cannot allocate {n} tokens after eviction "
                               f"(available {self.allocator.available_size()}); the trace does not fit kv_size")
        return out

    def _new_req(self, prompt: list[int], extra_key, final_turn: bool):
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        custom = {"k3_final_turn": True} if final_turn else None
        req = Req(rid=f"r{self._rid}", origin_input_text="", origin_input_ids=array("q", prompt),
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=1, custom_params=custom))
        self._rid += 1
        if self.cache.supports_mamba():   # the request's slot + the prompt-end checkpoint's copy
            short = 2 - self.pool.mamba_allocator.available_size()
            if short > 0:
                self._evict(mamba=short)
        if self.pool.alloc([req]) is None:
            raise RuntimeError("req_to_token_pool: no free request row")
        req.extra_key = extra_key
        return req

    def _track(self, req, computed: int) -> None:
        """With `--mamba-extra-buffer` the model runner records the state at the last checkpoint-grid point it
        passed (ping-pong slots); the cache keys what it recorded. Emulated: the grid point at or below `computed`."""
        if not getattr(self.cache, "enable_mamba_extra_buffer", False):
            return
        grid = self.grid
        point = computed // grid * grid
        req.kv.mamba_prev_track_seqlen = req.kv.mamba_last_track_seqlen
        req.kv.mamba_last_track_seqlen = point or None
        req.kv.mamba_last_track_idx = 0
        req.kv.mamba_next_track_idx = self.pool.get_mamba_ping_pong_other_idx(0)

    def _key_buffer(self):
        kv = self.allocator.get_kvcache()
        kv = getattr(kv, "full_kv_pool", kv)
        return kv.get_key_buffer(kv.start_layer)

    def _check_and_mark(self, matched: list[int], prefix, computed: list[int], slots, version: int) -> None:
        """KV slot marks: element 0 the token id, element 1 the policy version that computed it."""
        import torch

        buf = self._key_buffer()
        flat = buf.view(buf.shape[0], -1)
        if matched:
            held = flat[prefix, :2].float().to(torch.int64).tolist()
            for i, ((tok, ver), want) in enumerate(zip(held, matched)):
                if tok != want:
                    raise AssertionError(f"wrong prefix: position {i} holds token {tok}'s KV, the request has {want}")
                if ver != version:
                    raise AssertionError(f"wrong prefix: position {i}'s KV was computed by policy version {ver}, "
                                         f"the request is served by version {version}")
        if computed:
            flat[slots, 0] = torch.tensor(computed, dtype=torch.float32).to(buf.dtype)
            flat[slots, 1] = float(version)

    # -------------------------------------------------------------- weight updates
    def version_of(self, extra_key) -> int:
        return self.base_version + self.versions.get(extra_key, 0)

    def update_weights(self, extra_key: str | None = None, *, all_scopes: bool = False,
                       sglang_flush: bool = True) -> None:
        """A weight update (base: `all_scopes`; else the adapter behind `extra_key`). Ours bumps the scope;
        SGLang's cache is flushed (`sglang_flush`, what SGLang does on update_weights) or left as it is."""
        if all_scopes:
            self.base_version += 1
        else:
            self.versions[extra_key] = self.versions.get(extra_key, 0) + 1
        if hasattr(self.cache, "bump_policy_version"):
            self.cache.bump_policy_version(extra_key, all_scopes=all_scopes)
        elif sglang_flush:       # what the scheduler's flush_cache does (no request is running here)
            self.cache.reset()
            self.pool.clear()
            self.allocator.clear()
            self.pool.reset_aux_cache_allocator()

    @property
    def grid(self) -> int:
        for comp in self.cache._components_tuple:
            if hasattr(comp, "mamba_checkpoint_grid"):
                return comp.mamba_checkpoint_grid
        raise RuntimeError("cache: no Mamba component")

    # -------------------------------------------------------------- one request
    def serve(self, prompt: list[int], gen: list[int], *, extra_key: str | None = None, final_turn: bool = False,
              resume_len: int = 0) -> int:
        """Serve one request (prompt, then `gen` generated tokens; the last one is sampled, not computed) and
        return the prompt tokens the cache supplied."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang.test.mem_cache_utils import finish_req

        if not prompt or not gen:
            raise ValueError("serve: prompt and gen must be non-empty")
        cache = self.cache
        req = self._new_req(prompt, extra_key, final_turn)
        m = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt[:-1]), extra_key)))
        hit = m.device_prefix_len
        lock = cache.lock(m.last_device_node)
        prefix = cache.path_device_indices(m.last_device_node)[:hit]
        row = req.kv.req_pool_idx
        fill = prompt + gen[:-1]
        new = self._alloc_kv(len(fill) - hit)     # one run: paged allocators continue the last page
        self.pool.write((row, slice(0, hit)), prefix)
        self.pool.write((row, slice(hit, len(fill))), new)
        if self.verify_prefix:
            self._check_and_mark(prompt[:hit], prefix, fill[hit:], new, self.version_of(extra_key))
        req.kv.cache_protected_len = hit
        req.last_node, req.lock = m.last_device_node, lock
        req.full_untruncated_fill_ids = array("q", prompt)
        req.kv.kv_committed_len = len(prompt)
        self._track(req, len(prompt))
        cache.checkpoint(req, up_to=len(prompt))                     # prompt end (cache_unfinished_req)
        req.output_ids = array("q", gen[:-1])
        req.full_untruncated_fill_ids = array("q", fill)
        req.kv.kv_committed_len = len(fill)
        self._track(req, len(fill))
        finish_req(cache, req, up_to=len(fill))                      # turn end (cache_finished_req)
        self.pool.free(req)
        s = self.stats
        s.requests += 1
        s.prompt_tokens += len(prompt)
        s.hit_tokens += hit
        s.hits.append(hit)
        if resume_len:
            s.resume_requests += 1
            s.resume_tokens += resume_len
            s.resume_recomputed += max(0, resume_len - hit)
        return hit
