"""Prompt-lookup (n-gram) drafter: propose the tokens that followed the most recent earlier occurrence of the
sequence's own suffix (longest suffix first). No model, deterministic, a point-mass draft distribution."""
from __future__ import annotations


class NgramDrafter:
    def __init__(self, ngram_max: int = 4, ngram_min: int = 1):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"ngram_min/ngram_max: need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.ngram_max, self.ngram_min = ngram_max, ngram_min

    def propose(self, context: list[int], k: int) -> list[int]:
        """Up to k draft tokens continuing `context` (the sequence so far, its pending last token included);
        [] when no suffix of length >= ngram_min occurred before."""
        if k <= 0:
            return []
        L = len(context)
        for n in range(min(self.ngram_max, L - 1), self.ngram_min - 1, -1):
            suffix = context[L - n:]
            # most recent earlier occurrence whose continuation exists
            for start in range(L - n - 1, -1, -1):
                if context[start:start + n] == suffix:
                    follow = context[start + n:start + n + k]
                    if follow:
                        return follow
        return []
