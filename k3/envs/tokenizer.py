"""A small tokenizer defined in the repo for the calculator task: digits, operators, tool markers, a few words.
Numbers are spelled digit by digit. Ids 0/1/2 are pad/bos/eos (the tiny preset's special ids)."""
from __future__ import annotations

SPECIALS = ["<pad>", "<bos>", "<eos>"]
MARKERS = ["<call>", "</call>", "<result>", "</result>", "<answer>", "</answer>"]
WORDS = ["Q:", "compute", "error", "the", "is", "what"]
SYMBOLS = list("0123456789") + ["+", "-", "*", "/", "(", ")", "="]
_JOINED = frozenset("0123456789+-*/()")  # written without spaces between them ("=" stands alone)


class TokenizerError(ValueError):
    pass


class CalcTokenizer:
    def __init__(self) -> None:
        self.vocab = SPECIALS + MARKERS + WORDS + SYMBOLS
        self.ids = {t: i for i, t in enumerate(self.vocab)}
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2

    def __len__(self) -> int:
        return len(self.vocab)

    def __getitem__(self, token: str) -> int:
        return self.ids[token]

    def encode(self, text: str) -> list[int]:
        """Whitespace-separated words and markers; runs of digits/operators are split into characters."""
        out: list[int] = []
        for word in text.split():
            if word in self.ids:
                out.append(self.ids[word])
                continue
            for ch in word:
                if ch not in self.ids:
                    raise TokenizerError(f"text: no token for {ch!r} in {word!r}")
                out.append(self.ids[ch])
        return out

    def decode(self, ids: list[int]) -> str:
        """Tokens joined by spaces, runs of digits/operators joined into one word (inverse of `encode`)."""
        parts: list[str] = []
        prev_symbol = False
        for i in ids:
            if not 0 <= i < len(self.vocab):
                raise TokenizerError(f"ids: {i} is outside the vocabulary (size {len(self.vocab)})")
            tok = self.vocab[i]
            symbol = tok in _JOINED
            if symbol and prev_symbol:
                parts[-1] += tok
            else:
                parts.append(tok)
            prev_symbol = symbol
        return " ".join(parts)
