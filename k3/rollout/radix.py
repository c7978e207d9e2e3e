"""Radix tree over sequence keys (token ids + how each token was computed; see `types.py`), one tree per
(adapter id, policy version) scope. A node covers key positions [start, end); it holds the MLA pages covering
those positions (page-granular: [floor(start/P)*P, end), so a boundary page may be shared with the parent) and
optionally a KDA state checkpoint taken exactly at `end` (+ the logits/routing at end-1 when a turn's prompt ends
there). A match is the deepest node with a state. Every non-root leaf holds a state (a leaf without one is
useless and is removed), so every node on a path has its pages: dropping pages only ever removes leaves.

The tree stores ids; the owner passes callbacks that retain/release pages and release states, so the same tree
runs the engine (real pools) and the benchmark's policy replays (counters only).
"""
from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class Node:
    key: list[int]
    start: int
    parent: "Node | None" = None
    children: dict[int, "Node"] = field(default_factory=dict)
    pages: list[int] = field(default_factory=list)
    state: int | None = None
    extra: Any = None            # (logits, routing, drafter features or None) at end-1 for prompt-end checkpoints
    last_access: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.key)


@dataclass
class Match:
    node: Node | None     # deepest usable node (state present) or None
    hit: int              # its end (0 when none)
    prefix: int           # longest common prefix of the key with the tree (pages exist up to here)


def common_prefix(edge: list[int], key: list[int], pos: int = 0) -> int:
    """Length of the common prefix of `edge` and key[pos:]."""
    n = min(len(edge), len(key) - pos)
    c = 0
    while c < n and edge[c] == key[pos + c]:
        c += 1
    return c


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


class RadixTree:
    def __init__(self, page_size: int, retain_pages: Callable[[list[int]], None] = lambda p: None,
                 release_pages: Callable[[list[int]], None] = lambda p: None,
                 release_state: Callable[[int], None] = lambda s: None):
        self.P = page_size
        self.roots: dict[Hashable, Node] = {}
        self.retain_pages, self.release_pages, self.release_state = retain_pages, release_pages, release_state
        self.clock = 0
        self.stats = {"state_drops": 0, "node_evictions": 0, "splits": 0}

    # ------------------------------------------------------------------ lookup
    def root(self, scope: Hashable) -> Node:
        if scope not in self.roots:
            self.roots[scope] = Node([], 0)
        return self.roots[scope]

    def _tick(self, node: Node) -> None:
        self.clock += 1
        while node is not None:
            node.last_access = self.clock
            node = node.parent

    def match(self, scope: Hashable, key: list[int], usable: Callable[[Node], bool] | None = None,
              touch: bool = True) -> Match:
        """Deepest node on `key`'s path with a state (and `usable(node)`), ending at or before len(key).
        `touch=False` looks without refreshing the path's recency (a lookup that reuses nothing)."""
        node, pos = self.roots.get(scope), 0
        best: Node | None = None
        if node is None:
            return Match(None, 0, 0)
        L = len(key)
        while pos < L:
            child = node.children.get(key[pos])
            if child is None:
                break
            c = common_prefix(child.key, key, pos)
            if c < len(child.key):
                pos += c
                break
            pos += c
            node = child
            if node.state is not None and (usable is None or usable(node)):
                best = node
        if best is not None and touch:
            self._tick(best)
        return Match(best, best.end if best is not None else 0, pos)

    # ------------------------------------------------------------------ insert
    def insert(self, scope: Hashable, key: list[int], block_table: list[int], state: int | None = None,
               extra: Any = None) -> Node:
        """Make a node end exactly at len(key); new nodes retain their pages from `block_table` (page ids of
        positions [0, len(key))). `state` (ownership passes to the tree) becomes the node's checkpoint unless it
        already has one (then the duplicate is released)."""
        m = len(key)
        if m == 0:
            raise ValueError("key: cannot insert an empty key")
        if len(block_table) < _ceil(m, self.P):
            raise ValueError(f"block_table: {len(block_table)} pages cannot cover {m} positions")
        node, pos = self.root(scope), 0
        while pos < m:
            child = node.children.get(key[pos])
            if child is None:
                leaf = Node(list(key[pos:m]), pos, node)
                leaf.pages = list(block_table[pos // self.P:_ceil(m, self.P)])
                self.retain_pages(leaf.pages)
                node.children[key[pos]] = leaf
                node = leaf
                pos = m
                break
            c = common_prefix(child.key, key, pos)
            if c < len(child.key):
                child = self._split(child, pos + c)
            node, pos = child, pos + len(child.key)
        if state is not None:
            if node.state is None:
                node.state = state
            else:
                self.release_state(state)
        if extra is not None and node.extra is None:
            node.extra = extra
        self._tick(node)
        return node

    def _split(self, node: Node, at: int) -> Node:
        """Cut `node` at absolute position `at`; returns the upper part (ends at `at`)."""
        cut = at - node.start
        upper = Node(node.key[:cut], node.start, node.parent, last_access=node.last_access)
        base = node.start // self.P
        upper.pages = node.pages[:_ceil(at, self.P) - base]
        lower_pages = node.pages[at // self.P - base:]
        shared = [p for p in upper.pages if p in set(lower_pages)]
        self.retain_pages(shared)
        upper.children = {node.key[cut]: node}
        node.parent.children[upper.key[0]] = upper
        node.key, node.start, node.parent, node.pages = node.key[cut:], at, upper, lower_pages
        self.stats["splits"] += 1
        return upper

    # ------------------------------------------------------------------ eviction
    def nodes(self):
        stack = list(self.roots.values())
        while stack:
            n = stack.pop()
            if n.parent is not None:
                yield n
            stack.extend(n.children.values())

    def drop_state(self, node: Node) -> None:
        """Release a node's checkpoint; a leaf left without one is removed (its pages released)."""
        if node.state is not None:
            self.release_state(node.state)
            node.state = None
            node.extra = None
            self.stats["state_drops"] += 1
        self._prune(node)

    def _prune(self, node: Node) -> None:
        while node.parent is not None and not node.children and node.state is None:
            parent = node.parent
            del parent.children[node.key[0]]
            self.release_pages(node.pages)
            node.pages = []
            node.parent = None
            self.stats["node_evictions"] += 1
            node = parent

    def evict_leaf(self, node: Node) -> None:
        """Drop a leaf: its state first, then its pages."""
        if node.children:
            raise ValueError("node: only leaves can lose their pages")
        self.drop_state(node)

    def lru(self, pred: Callable[[Node], bool]) -> Node | None:
        best = None
        for n in self.nodes():
            if pred(n) and (best is None or n.last_access < best.last_access):
                best = n
        return best

    def drop_scope(self, scope: Hashable) -> None:
        """Release everything under a scope (a weight update makes the old version unreachable)."""
        root = self.roots.pop(scope, None)
        if root is None:
            return
        stack = list(root.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.state is not None:
                self.release_state(n.state)
            self.release_pages(n.pages)

    # ------------------------------------------------------------------ invariants
    def check(self) -> None:
        for scope, root in self.roots.items():
            assert root.parent is None and not root.key and root.state is None, f"scope {scope}: bad root"
            stack = [root]
            while stack:
                n = stack.pop()
                for first, ch in n.children.items():
                    assert ch.parent is n, "child's parent pointer is wrong"
                    assert ch.key and ch.key[0] == first, "child stored under the wrong first key element"
                    assert ch.start == n.end, f"child starts at {ch.start}, parent ends at {n.end}"
                    want = _ceil(ch.end, self.P) - ch.start // self.P
                    assert len(ch.pages) == want, f"node [{ch.start},{ch.end}) holds {len(ch.pages)} pages, want {want}"
                    stack.append(ch)
                if n.parent is not None:
                    assert n.children or n.state is not None, f"leaf [{n.start},{n.end}) has no state"
