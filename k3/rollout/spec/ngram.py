"""Prompt-lookup (n-gram) drafter: propose the tokens that followed the most recent earlier occurrence of the
sequence's own suffix (longest suffix first). No model, deterministic, a point-mass draft distribution. Trees: the
continuations of several earlier occurrences, merged."""
from __future__ import annotations

from k3.rollout.spec.tree import DraftTree, build_tree


def _check_range(ngram_max: int, ngram_min: int) -> None:
    if not 1 <= ngram_min <= ngram_max:
        raise ValueError(f"ngram_min/ngram_max: need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")


class NgramDrafter:
    def __init__(self, ngram_max: int = 4, ngram_min: int = 1):
        _check_range(ngram_max, ngram_min)
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
        return build_tree(self.paths(context, depth), branching, depth, max_nodes)

    def paths(self, context: list[int], depth: int) -> list[list[int]]:
        """propose_tree's paths, before they are merged into a trie: the continuations (up to `depth` tokens) of
        every earlier occurrence of each suffix, longer suffixes first, most recent first."""
        L = len(context)
        paths = []
        for n in range(min(self.ngram_max, L - 1), self.ngram_min - 1, -1):
            suffix = context[L - n:]
            for start in range(L - n - 1, -1, -1):
                if context[start:start + n] == suffix and start + n < L:
                    paths.append(context[start + n:start + n + depth])
        return paths


class SuffixIndex:
    """NgramDrafter's scans as look-ups over one growing sequence (a running row's context): every token -> the
    positions just past its occurrences, ascending. A suffix's earlier occurrences are found among the positions
    after its last token (checked back to ngram_max tokens), so `extend` costs O(new tokens) (not O(n-grams), as
    indexing every n-gram would) and a look-up O(occurrences of the last token x ngram_max) instead of
    NgramDrafter's O(context) scan; `match` and `paths`
    return exactly what NgramDrafter.match / propose_tree's paths return for the same sequence
    (tests/rollout/test_spec_drafter.py checks them against the scans)."""

    def __init__(self, ngram_max: int = 4, ngram_min: int = 1):
        _check_range(ngram_max, ngram_min)
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.tokens: list[int] = []
        # token -> ends e (tokens[e - 1] is the token), every e <= len(tokens) - 1: an occurrence with a
        # continuation (the last token itself is indexed once a token follows it)
        self._ends: dict[int, list[int]] = {}

    def extend(self, new: list[int]) -> None:
        """Append `new` tokens to the sequence."""
        old = len(self.tokens)
        self.tokens.extend(new)
        toks, ends = self.tokens, self._ends
        for e in range(max(old, 1), len(toks)):   # ends that now have a continuation: old .. L - 1
            ends.setdefault(toks[e - 1], []).append(e)

    def _occurrences(self, n: int, candidates: list[int]):
        """The ends e of the earlier occurrences of the length-n suffix among `candidates` (the ends after the
        last token), most recent first."""
        toks = self.tokens
        suffix = toks[len(toks) - n:]
        return (e for e in reversed(candidates) if e >= n and toks[e - n:e] == suffix)

    def _lengths(self):
        """(n, candidates) for each suffix length n, longest first (candidates: the ends after the last token)."""
        toks, L = self.tokens, len(self.tokens)
        candidates = self._ends.get(toks[-1], []) if L else []
        return ((n, candidates) for n in range(min(self.ngram_max, L - 1), self.ngram_min - 1, -1))

    def match(self, k: int) -> tuple[list[int], int]:
        """NgramDrafter.match of the sequence: up to k tokens after the most recent earlier occurrence of the
        longest suffix found, and that suffix's length (0: none)."""
        if k <= 0:
            return [], 0
        for n, candidates in self._lengths():
            e = next(self._occurrences(n, candidates), None)
            if e is not None:
                return self.tokens[e:e + k], n
        return [], 0

    def paths(self, depth: int) -> list[list[int]]:
        """NgramDrafter.propose_tree's paths: the continuations (up to `depth` tokens) of every earlier occurrence
        of each suffix, longer suffixes first, most recent first."""
        return [self.tokens[e:e + depth] for n, candidates in self._lengths()
                for e in self._occurrences(n, candidates)]
