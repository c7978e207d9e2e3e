"""Token trees for speculative decoding: what a drafter proposes (a chain is a tree with one child per node) and
the tree-shaped tensors a batched verify needs (ancestor masks, parent indices, depths).

Nodes are numbered 0..n-1 in an order where every parent comes before its children (drafters build them breadth
first); `parents[i]` is the parent node, -1 for a child of the root (the row's pending token, verify position 0).
Siblings carry distinct tokens, listed in the drafter's order of preference (the acceptance walk tries them in
that order).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"DraftTree: {len(self.tokens)} tokens but {len(self.parents)} parents")
        seen: set[tuple[int, int]] = set()
        for i, (t, p) in enumerate(zip(self.tokens, self.parents)):
            if not -1 <= p < i:
                raise ValueError(f"DraftTree: node {i}'s parent {p} is not an earlier node (or -1, the root)")
            if (p, t) in seen:
                raise ValueError(f"DraftTree: node {i} repeats its sibling's token {t}")
            seen.add((p, t))

    @staticmethod
    def chain(tokens: list[int]) -> "DraftTree":
        return DraftTree(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self, node: int) -> list[int]:
        """Children of `node` (-1: the root), in preference order."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def depths(self) -> list[int]:
        """Depth of every node (a child of the root: 1)."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return d

    @property
    def depth(self) -> int:
        return max(self.depths(), default=0)

    def path(self, node: int) -> list[int]:
        """Nodes from the root's child down to `node` (inclusive)."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def fits(self, branching: int, depth: int) -> bool:
        """At most `branching` children per node (the root included) and at most `depth` levels."""
        counts: dict[int, int] = {}
        for p in self.parents:
            counts[p] = counts.get(p, 0) + 1
        return all(c <= branching for c in counts.values()) and self.depth <= depth

    # ------------------------------------------------------------------ tensors of a batched tree verify
    def verify_parents(self) -> list[int]:
        """Parent of every verify position: position 0 is the pending token (-1), position i + 1 is node i."""
        return [-1] + [p + 1 for p in self.parents]

    def ancestor_mask(self) -> torch.Tensor:
        """[n+1, n+1] bool over verify positions: position i sees position j iff j is i or one of its ancestors
        (the tree attention mask, beside the prefix every position sees)."""
        par = self.verify_parents()
        n = len(par)
        m = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while j >= 0:
                m[i, j] = True
                j = par[j]
        return m


def build_tree(paths: list[list[int]], branching: int, depth: int, max_nodes: int) -> DraftTree:
    """A tree from candidate continuations in preference order (a trie): each path adds the nodes it does not
    share with earlier ones, while the node has fewer than `branching` children, the depth is <= `depth` and the
    tree has < `max_nodes` nodes."""
    tokens: list[int] = []
    parents: list[int] = []
    kids: dict[int, dict[int, int]] = {-1: {}}
    for path in paths:
        node = -1
        for tok in path[:depth]:
            nxt = kids[node].get(tok)
            if nxt is None:
                if len(kids[node]) >= branching or len(tokens) >= max_nodes:
                    break
                nxt = len(tokens)
                tokens.append(tok)
                parents.append(node)
                kids[node][tok] = nxt
                kids[nxt] = {}
            node = nxt
    return DraftTree(tuple(tokens), tuple(parents))
