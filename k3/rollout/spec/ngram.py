"""Prompt-lookup (n-gram) drafter: propose the tokens that followed the most recent earlier occurrence of the
sequence's own suffix (longest suffix first). No model, deterministic, a point-mass draft distribution. Trees: the
continuations of several earlier occurrences, merged."""
from __future__ import annotations

from k3.rollout.spec.tree import DraftTree, build_tree


class NgramDrafter:
    def __init__(self, ngram_max: int = 4, ngram_min: int = 1):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"ngram_min/ngram_max: need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.ngram_max, self.ngram_min = ngram_max, ngram_min

    def propose(self, context: list[int], k: int) -> list[int]:
        """Up to k draft tokens continuing `context` (the sequence so far, its pending last token included);
        [] when no suffix of length >= ngram_min occurred before."""
        return self.match(context, k)[0]

    def match(self, context: list[int], k: int) -> tuple[list[int], int]:
        """`propose`'s tokens and the length of the suffix they continue (0: none found)."""
        if k <= 0:
            return [], 0
        L = len(context)
        for n in range(min(self.ngram_max, L - 1), self.ngram_min - 1, -1):
            suffix = context[L - n:]
            # most recent earlier occurrence whose continuation exists
            for start in range(L - n - 1, -1, -1):
                if context[start:start + n] == suffix:
                    follow = context[start + n:start + n + k]
                    if follow:
                        return follow, n
        return [], 0

    def propose_tree(self, context: list[int], branching: int, depth: int, max_nodes: int) -> DraftTree:
        """A token tree of alternative continuations: the tokens that followed every earlier occurrence of the
        longest matching suffixes (most recent first, longer suffixes first), merged into a trie of at most
        `branching` children per node. With branching 1 it is `propose`'s chain."""
        if branching == 1:
            return DraftTree.chain(self.propose(context, min(depth, max_nodes)))
        L = len(context)
        paths = []
        for n in range(min(self.ngram_max, L - 1), self.ngram_min - 1, -1):
            suffix = context[L - n:]
            for start in range(L - n - 1, -1, -1):
                if context[start:start + n] == suffix and start + n < L:
                    paths.append(context[start + n:start + n + depth])
        return build_tree(paths, branching, depth, max_nodes)
