"""K3RadixCache on SGLang's own unified-radix-cache kit: every one of the kit's 19 `CONFIGS` (FULL, FULL+MAMBA with
and without the extra buffer, SWA windows, page sizes 1-128), the kit's `build_fixture` pools, with the fixture's
class replaced through SGLang's real selection path (`register_radix_cache_backend`, `--radix-cache-backend k3` in
the published server args, `create_tree_cache`). Differential against SGLang's `UnifiedRadixCache` on identical
traces, driven like the scheduler (`k3_sglang.radix_replay`), with every hit's KV slots checked to hold the
request's tokens as computed by the request's policy version (a wrong prefix fails the test):

- before any weight update ours makes SGLang's decisions exactly (same hit on every request);
- after an update of one adapter: SGLang without a flush serves the old version's KV (caught as a wrong prefix),
  SGLang with its flush loses every adapter's entries; ours loses only the updated scope's;
- under memory pressure, a finished episode's last turn goes before a turn that will be resumed: the resume hits
  with ours and misses with SGLang's LRU.
"""
import dataclasses
import random

import pytest

pytest.importorskip("sglang")

from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from sglang.test.kits.unified_radix_cache.config import CONFIGS  # noqa: E402

from k3_sglang.radix_cache import K3RadixCache  # noqa: E402
from k3_sglang.radix_replay import CacheDriver  # noqa: E402

IDS = [c.label for c in CONFIGS]


def sized(cfg):
    """The kit's config, its KV pool enlarged where the extra buffer's 64-token state grid needs longer sequences
    than the pool holds (FULL+MAMBA page 4: 256 slots); components, page size, windows and layers unchanged."""
    grid = max(64, cfg.page_size) if cfg.enable_mamba_extra_buffer else 1
    need = 16 * max(grid, cfg.page_size)
    if cfg.kv_size >= need:
        return cfg
    return dataclasses.replace(cfg, kv_size=need, max_context_len=max(cfg.max_context_len, need))


def unit(d: CacheDriver) -> int:
    """Smallest length the cache can checkpoint at: a page, or the state grid with the extra buffer."""
    return max(d.cfg.page_size, d.grid if getattr(d.cache, "enable_mamba_extra_buffer", False) else 1)


def toks(rnd: random.Random, n: int) -> list[int]:
    return [rnd.randrange(3, 250) for _ in range(n)]   # < 256: exact in the bf16 KV marks


def episodes(rnd, u: int, n: int, turns: int, shared: list[int]):
    """n multi-turn episodes sharing a system prompt: (prompt, gen) per turn, later turns extend the earlier."""
    out = []
    for _ in range(n):
        prompt, eps = shared + toks(rnd, u + 3), []
        for _ in range(turns):
            gen = toks(rnd, u // 2 + 2)
            eps.append((prompt, gen))
            prompt = prompt + gen[:-1] + toks(rnd, 5)
        out.append(eps)
    return out


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_kit_trace_same_decisions_as_sglang(cfg):
    ours, theirs = CacheDriver(sized(cfg), "k3", verify_prefix=True), CacheDriver(sized(cfg), "sglang", verify_prefix=True)
    assert type(ours.cache) is K3RadixCache and type(theirs.cache) is UnifiedRadixCache
    assert ours.cache._tree_core_backend == theirs.cache._tree_core_backend
    u = unit(ours)
    rnd = random.Random(cfg.page_size * 31 + len(cfg.components))
    eps = episodes(rnd, u, n=3, turns=2, shared=toks(rnd, 2 * u))
    for t in range(2):
        for e in eps:
            prompt, gen = e[t]
            assert ours.serve(prompt, gen) == theirs.serve(prompt, gen)
    assert ours.stats.hits == theirs.stats.hits
    assert sum(ours.stats.hits) > 0, "the trace should hit at all (else it checks nothing)"


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_kit_adapter_update_scopes(cfg):
    rnd = random.Random(7)
    cfg = sized(cfg)
    drivers = {"ours": CacheDriver(cfg, "k3", verify_prefix=True),
               "sglang_flush": CacheDriver(cfg, "sglang", verify_prefix=True),
               "sglang_no_flush": CacheDriver(cfg, "sglang", verify_prefix=True)}
    u = unit(drivers["ours"])
    a_prompt, a_gen = toks(rnd, 2 * u + 3), toks(rnd, u // 2 + 2)
    b_prompt, b_gen = toks(rnd, 2 * u + 3), toks(rnd, u // 2 + 2)
    resume = lambda p, g: p + g[:-1] + [7, 8, 9]
    hits = {}
    for name, d in drivers.items():
        d.serve(a_prompt, a_gen)
        d.serve(b_prompt, b_gen, extra_key="lora-b")
        d.update_weights(None, sglang_flush=name == "sglang_flush")   # the base-model namespace's adapter update
        if name == "sglang_no_flush":
            with pytest.raises(AssertionError, match="policy version"):
                d.serve(resume(a_prompt, a_gen), [1, 2])
            continue
        hits[name] = (d.serve(resume(a_prompt, a_gen), [1, 2]),
                      d.serve(resume(b_prompt, b_gen), [1, 2], extra_key="lora-b"))
    assert hits["ours"][0] == 0 and hits["sglang_flush"] == (0, 0)
    assert hits["ours"][1] > 0, "the other adapter's entries survive our update"
    # an update of every scope (base weights) leaves nothing to match
    d = drivers["ours"]
    d.update_weights(all_scopes=True)
    assert d.serve(resume(b_prompt, b_gen), [1, 2], extra_key="lora-b") == 0


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_kit_final_turn_evicted_before_pending_resume(cfg):
    rnd = random.Random(11)
    out = {}
    for backend in ("k3", "sglang"):
        d = CacheDriver(sized(cfg), backend, verify_prefix=True)
        u = unit(d)
        pending_prompt, pending_gen = toks(rnd.__class__(1), 2 * u + 3), toks(rnd.__class__(2), u + 2)
        final_prompt, final_gen = toks(rnd.__class__(3), 2 * u + 3), toks(rnd.__class__(4), u + 2)
        d.serve(pending_prompt, pending_gen)                       # its episode continues after a tool call
        d.serve(final_prompt, final_gen, final_turn=True)          # its episode is over (more recent)
        # room for one episode: as many tokens as the finished one holds, and one state
        d.cache.evict(EvictParams(num_tokens=len(final_prompt) + len(final_gen) - 1,
                                  mamba_num=1 if d.cache.supports_mamba() else 0))
        out[backend] = d.serve(pending_prompt + pending_gen[:-1] + [5, 6, 7], [1, 2])
    assert out["k3"] > 0, "our eviction dropped the state a pending resume needs"
    assert out["k3"] > out["sglang"], "SGLang's LRU was expected to drop the older, pending turn"


def test_bad_backend_and_bad_scope_named():
    from k3_sglang.radix_replay import build_cache
    with pytest.raises(ValueError, match="backend"):
        build_cache(CONFIGS[0], "lmcache")
    d = CacheDriver(CONFIGS[0], "k3")
    with pytest.raises(ValueError, match="extra_key"):
        d.cache.bump_policy_version("a", all_scopes=True)
    with pytest.raises(ValueError, match="extra_key"):
        d.cache.bump_policy_version(3)
    with pytest.raises(ValueError, match="prompt and gen"):
        d.serve([], [1])
