"""K3's RL-aware prefix cache inside SGLang: a `UnifiedRadixCache` subclass, selected with `--radix-cache-backend k3`.

SGLang's unified tree already keeps MLA KV and KDA (Mamba-pool) states aligned on one radix tree, checkpoints a
finished request's state at the end of its committed tokens (page size 1; with `--mamba-extra-buffer` at its last
tracked point), backs both up to host memory (HiCache) and evicts LRU. What an RL rollout fleet needs beyond that,
and what this class adds through the class's own methods (no SGLang file changed):

- **Scope by policy version and adapter.** After a weight update the old KV/states are wrong for the new policy;
  SGLang's answer is `flush_cache` (everything goes, and only on an idle engine), and an adapter reloaded under the
  same name keeps matching its stale entries. Here `bump_policy_version()` (a base-weight update: every scope) and
  `bump_policy_version(extra_key)` (one adapter; SGLang concatenates the LoRA id into `extra_key`) move the matching
  requests to a fresh namespace: stale entries can never match again (no wrong prefix), in-flight requests finish on
  the entries they hold, other adapters keep their hits, and the stale entries, never touched again, are the LRU
  end and go first. Before any bump the keys are SGLang's unchanged, so the class behaves exactly as SGLang's.
- **Turn-boundary retention.** A multi-turn episode comes back after its tool call and resumes from its turn-end
  state; a finished episode never does. A request whose `sampling_params.custom_params` carries
  `{"k3_final_turn": true}` (the rollout driver knows) has its tree leaf moved to the evict-first end of every
  component's LRU list when it finishes, so under memory pressure the states pending resumes need outlive the
  states of episodes that are over (SGLang's LRU keeps the latter, the most recently used, and drops the former).

The project's own engine (k3/rollout/radix.py) shares the policy; the pools and the tree here stay SGLang's.
"""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Hashable

from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

BACKEND = "k3"
FINAL_TURN = "k3_final_turn"    # sampling_params.custom_params key: this request ends its episode
_TAG = "\x1fk3v"                # separates the caller's extra_key from our version tag


class K3RadixCache(UnifiedRadixCache):
    """`UnifiedRadixCache` + policy-version/adapter scopes + turn-boundary retention (module doc)."""

    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, **kwargs)
        self.base_version = 0
        self.adapter_versions: dict[Hashable, int] = {}
        self.k3_stats = {"version_bumps": 0, "final_turn_demotions": 0}
        self._demote_clock = 0.0       # below every real access time (SGLang's counter starts at 0 and grows)

    # ------------------------------------------------------------------ scopes
    def bump_policy_version(self, extra_key: str | None = None, *, all_scopes: bool = False) -> None:
        """A weight update: `all_scopes=True` for the base weights (every namespace), else the one `extra_key`
        namespace (an adapter; None is the base model without adapter or salt)."""
        if all_scopes:
            if extra_key is not None:
                raise ValueError("extra_key: give one adapter's key or all_scopes=True, not both")
            self.base_version += 1
        else:
            if extra_key is not None and not isinstance(extra_key, str):
                raise ValueError(f"extra_key: must be a str or None, got {type(extra_key).__name__}")
            self.adapter_versions[extra_key] = self.adapter_versions.get(extra_key, 0) + 1
        self.k3_stats["version_bumps"] += 1

    def scope_tag(self, extra_key: str | None) -> str | None:
        """The namespace SGLang's tree sees for a request's `extra_key` now."""
        if extra_key is not None and _TAG in extra_key:
            return extra_key            # already scoped (a key this class built)
        a = self.adapter_versions.get(extra_key, 0)
        if self.base_version == 0 and a == 0:
            return extra_key            # never updated: SGLang's namespace, unchanged
        return f"{extra_key or ''}{_TAG}{self.base_version}.{a}"

    def scoped_key(self, key):
        if key is None:
            return key
        tag = self.scope_tag(key.extra_key)
        if tag == key.extra_key:
            return key
        scoped = copy.copy(key)
        scoped.extra_key = tag
        return scoped

    def match_prefix(self, params):
        return super().match_prefix(dataclasses.replace(params, key=self.scoped_key(params.key)))

    def insert(self, params):
        return super().insert(dataclasses.replace(params, key=self.scoped_key(params.key)))

    def touch_prefix(self, key) -> None:
        super().touch_prefix(self.scoped_key(key))

    # ------------------------------------------------------------------ turn-boundary retention
    def checkpoint_into_tree(self, req, *, up_to: int, **kwargs) -> None:
        super().checkpoint_into_tree(req, up_to=up_to, **kwargs)
        if req.finished() and is_final_turn(req) and req.last_node is not None:
            self._demote(req.last_node)

    def _demote(self, node_id) -> None:
        """Move the episode's own path (the leaf and its single-child ancestors, up to the first node another
        request shares) to the evict-first end of each component's device LRU list, leaf last so it goes first.
        Python tree core only; the session partition keeps its own order and is left alone."""
        if self.enable_session_radix_cache or not hasattr(self.tree_core, "node_by_id"):
            return
        node = self.tree_core.node_by_id(node_id)
        root = self.tree_core.root_node
        if node is root or node.children:
            return
        path = [node]
        while path[-1].parent is not None and path[-1].parent is not root and len(path[-1].parent.children) == 1:
            path.append(path[-1].parent)
        # FULL evicts leaves by `eviction_strategy.get_priority` (LRU: last_access_time); the other components walk
        # their LRU lists. Both orders put the path first, the leaf before its ancestors.
        for n in path:
            self._demote_clock -= 1
            n.last_access_time = self._demote_clock
        for lru in self.tree_core.lru_lists.values():
            pt = lru._pt
            for n in reversed(path):                  # root-most first: the leaf ends up at the very end
                if lru.in_list(n):
                    lru._remove_node(n)
                    lru._add_node_after(lru.tail.lru_prev[pt], n)
        self.k3_stats["final_turn_demotions"] += 1


def is_final_turn(req) -> bool:
    sp = getattr(req, "sampling_params", None)
    custom = getattr(sp, "custom_params", None) or {}
    return bool(custom.get(FINAL_TURN, False))


def k3_radix_cache_factory(ctx):
    """`register_radix_cache_backend` factory: SGLang's own construction path (components, HiCache, linker) with
    our class."""
    from sglang.srt.mem_cache.registry import create_unified_radix_cache

    return create_unified_radix_cache(ctx, cache_class=K3RadixCache)


def register() -> None:
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    if get_radix_cache_factory(BACKEND) is None:
        register_radix_cache_backend(BACKEND, k3_radix_cache_factory)
