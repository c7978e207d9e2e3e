"""Speculative-decoding settings of the embedded engine (a typed frozen config) and its string form for job
configs (`rollout.speculative="ngram:3"`)."""
from __future__ import annotations

import enum
from dataclasses import dataclass

# The verify pass feeds the pending token plus the draft: at most 16 positions, the KDA decode (recurrent) path.
MAX_DRAFT_LEN = 15


class SpecMethod(str, enum.Enum):
    """Where drafts come from. NGRAM: prompt lookup over the sequence's own tokens (no model). DRAFTER: a trained
    EAGLE3-style head over the target's hidden states (`k3.rollout.spec.drafter`, `k3 train-drafter`)."""
    NGRAM = "ngram"
    DRAFTER = "drafter"


class VerifyMode(str, enum.Enum):
    """How the target computes the k+1 verify positions.

    EXACT: each position runs with decode's shapes (one token per row, the engine's decode batch), so logits,
      log-probs, tokens and the committed states are bitwise those of plain decoding. On CPU the batch-invariant ops
      (row-block GEMMs, per-row MLA) are invariant to the number of rows, not to the number of tokens per row, and
      elementwise kernels take scalar tails that depend on the tensor size: a [B, k+1] forward differs from k+1
      [B, 1] forwards in the last bits. The price: k+1 decode-shaped passes per verify (no fewer passes than plain
      decoding; speculation then only pays where a pass costs less than a token, see benchmarks/spec_decode.py).
    BATCHED: one target forward over [B, k+1] positions (what makes speculation pay on a GPU). Close to plain
      decoding (rounding), not bitwise.
    Both store only the KDA step inputs per draft position and commit by ReplaySSM.
    """
    EXACT = "exact"
    BATCHED = "batched"


class Acceptance(str, enum.Enum):
    """How sampled (temperature > 0) drafts are accepted; greedy rows keep the matching prefix either way.

    REJECTION: standard speculative rejection sampling: accept draft d with probability min(1, p(d)/q(d)), else
      draw from the residual. The emitted tokens are distributed as the target's samples (not the same samples).
    MATCH: draw each position's token exactly as plain decoding does (the request's own generator, one draw per
      emitted token) and keep going while it equals the draft. For point-mass drafts (n-gram, a greedy drafter)
      the acceptance probability is the same p(d), and the emitted tokens are bitwise plain decoding's samples, so
      a job's rollouts, rewards and KL do not change at all.
    """
    REJECTION = "rejection"
    MATCH = "match"


@dataclass(frozen=True)
class SpecConfig:
    method: SpecMethod = SpecMethod.NGRAM
    draft_len: int = 3                 # draft tokens per verify (chain)
    verify: VerifyMode = VerifyMode.EXACT
    ngram_max: int = 4                 # prompt lookup: longest suffix matched
    ngram_min: int = 1                 # shortest suffix matched
    drafter_path: str | None = None    # method=drafter: the trained head's directory (None: the cached default)
    acceptance: Acceptance = Acceptance.REJECTION

    def __post_init__(self) -> None:
        for name, enum_type in (("method", SpecMethod), ("verify", VerifyMode), ("acceptance", Acceptance)):
            v = getattr(self, name)
            if not isinstance(v, enum_type):
                try:
                    object.__setattr__(self, name, enum_type(v))
                except ValueError:
                    raise ValueError(f"speculative.{name}: must be one of {[m.value for m in enum_type]}, "
                                     f"got {v!r}") from None

    def validate(self) -> None:
        for name in ("draft_len", "ngram_max", "ngram_min"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"speculative.{name}: expected an integer, got {type(v).__name__} ({v!r})")
        if not 1 <= self.draft_len <= MAX_DRAFT_LEN:
            raise ValueError(f"speculative.draft_len: must be in [1, {MAX_DRAFT_LEN}] (the verify pass holds the "
                             f"pending token plus the draft in at most {MAX_DRAFT_LEN + 1} positions), "
                             f"got {self.draft_len}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"speculative.ngram_min/ngram_max: need 1 <= ngram_min <= ngram_max, got "
                             f"{self.ngram_min}, {self.ngram_max}")
        if self.drafter_path is not None and not isinstance(self.drafter_path, str):
            raise ValueError(f"speculative.drafter_path: expected a str path, got {type(self.drafter_path).__name__}")

    @staticmethod
    def parse(text: str) -> "SpecConfig | None":
        """'off' | 'METHOD[:DRAFT_LEN[:VERIFY[:ACCEPTANCE]]]', e.g. 'ngram:3', 'drafter:3:exact:match'."""
        if not isinstance(text, str):
            raise ValueError(f"speculative: expected a string like 'ngram:3' or 'off', got {type(text).__name__}")
        if text.strip().lower() in ("", "off", "none"):
            return None
        parts = text.strip().split(":")
        if len(parts) > 4:
            raise ValueError(f"speculative: expected 'METHOD[:DRAFT_LEN[:VERIFY[:ACCEPTANCE]]]', got {text!r}")
        kw: dict = {"method": parts[0]}
        if len(parts) > 1:
            try:
                kw["draft_len"] = int(parts[1])
            except ValueError:
                raise ValueError(f"speculative: draft length {parts[1]!r} in {text!r} is not an integer") from None
        if len(parts) > 2:
            kw["verify"] = parts[2]
        if len(parts) > 3:
            kw["acceptance"] = parts[3]
        cfg = SpecConfig(**kw)
        cfg.validate()
        return cfg
