"""Speculative-decoding settings of the embedded engine (a typed frozen config) and its string form for job
configs (`rollout.speculative="ngram:3"`)."""
from __future__ import annotations

import enum
from dataclasses import dataclass

# The verify pass feeds the pending token plus the draft: at most 16 positions (a chain of 15 draft tokens, or a
# tree of at most 15 draft nodes), the KDA decode (recurrent) path.
MAX_DRAFT_LEN = 15
MAX_TREE_NODES = MAX_DRAFT_LEN


class SpecMethod(str, enum.Enum):
    """Where drafts come from. NGRAM: prompt lookup over the sequence's own tokens (no model). DRAFTER: a trained
    EAGLE3-style head over the target's hidden states (`k3.rollout.spec.drafter`, `k3 train-drafter`)."""
    NGRAM = "ngram"
    DRAFTER = "drafter"


class VerifyMode(str, enum.Enum):
    """How the target computes the k+1 verify positions.

    EXACT: each position runs with decode's shapes (one token per row, the engine's decode batch), so logits,
      log-probs, tokens and the committed states are bitwise those of plain decoding on every device. The price:
      k+1 decode-shaped passes per verify (no fewer passes than plain decoding; speculation then only pays where a
      pass costs less than a token, see benchmarks/spec_decode.py).
    BATCHED: one target forward over [B, k+1] positions (what makes speculation pay on a GPU). On CPU, chains and
      token trees are bitwise plain decoding: every op gives a token the bits of a one-token call (row-block GEMMs,
      MLA query by query over its own keys, position-invariant elementwise ops where a token has few values,
      contiguous reductions; tests/model/test_verify_shapes.py). On CUDA close (rounding), not bitwise: cuBLAS
      picks its kernel by the row count (`k3_kernels.batch_invariant` is the replacement, not wired yet).
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


class DrafterDtype(str, enum.Enum):
    """The trained head's weights and arithmetic at draft time (its RMS norms reduce in fp32 either way). AUTO (the
    default): FLOAT8 on CUDA (the faster head on the H200: k3/rollout/spec/NOTES.md), TARGET elsewhere. TARGET: the target model's parameter dtype (bf16 for a bf16 target, fp32
    for the CPU tiny model).
    FLOAT32: as trained. BFLOAT16: half the bytes a draft step reads (at K3's width the head's fuse / mix / up /
    down matrices are 1.8 GB in fp32, read once (fuse) and three times (the rest) for a chain of 3). FLOAT8: those
    four matrices in e4m3 with one scale per output row (k3_kernels.fp8_linear; a quarter of fp32's bytes), the
    activations in the target's dtype. The values other than "auto", "target" and "float8" are the torch dtypes'
    names."""
    AUTO = "auto"
    TARGET = "target"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT8 = "float8"

    def resolved(self, device_type: str) -> "DrafterDtype":
        """The concrete choice on a device of this type (AUTO -> FLOAT8 on CUDA, TARGET elsewhere)."""
        if self is DrafterDtype.AUTO:
            return DrafterDtype.FLOAT8 if device_type == "cuda" else DrafterDtype.TARGET
        return self

    def torch_dtype(self, target: "torch.dtype") -> "torch.dtype":
        """The dtype of the head's activations (and, but for FLOAT8, its weights) for a target whose parameters
        are `target` (a resolved choice: not AUTO)."""
        import torch
        if self is DrafterDtype.AUTO:
            raise ValueError("drafter_dtype: resolve 'auto' for a device first (DrafterDtype.resolved)")
        return target if self in (DrafterDtype.TARGET, DrafterDtype.FLOAT8) else getattr(torch, self.value)


@dataclass(frozen=True)
class SpecConfig:
    method: SpecMethod = SpecMethod.NGRAM
    draft_len: int = 3                 # draft tokens per verify (chain), or the tree's depth (branching > 1)
    branching: int = 1                 # token trees: at most this many children per node (top-k); 1 = a chain
    verify: VerifyMode = VerifyMode.EXACT
    ngram_max: int = 4                 # prompt lookup: longest suffix matched
    ngram_min: int = 1                 # shortest suffix matched
    drafter_path: str | None = None    # method=drafter: the trained head's directory (None: the cached default)
    acceptance: Acceptance = Acceptance.REJECTION
    # method=drafter: prompt lookup beside the head (copies, which the head cannot make; decode.SpecDecoder.
    # _with_lookup): a suffix of >= `lookup` tokens found earlier in the row's sequence drafts its continuation
    # first, a shorter one only when it agrees with the head's first token; 0 = the head alone. (method=ngram is
    # prompt lookup itself and ignores it.)
    lookup: int = 2
    drafter_dtype: DrafterDtype = DrafterDtype.AUTO     # method=drafter: the head's precision at draft time

    def __post_init__(self) -> None:
        for name, enum_type in (("method", SpecMethod), ("verify", VerifyMode), ("acceptance", Acceptance),
                                ("drafter_dtype", DrafterDtype)):
            v = getattr(self, name)
            if not isinstance(v, enum_type):
                try:
                    object.__setattr__(self, name, enum_type(v))
                except ValueError:
                    raise ValueError(f"speculative.{name}: must be one of {[m.value for m in enum_type]}, "
                                     f"got {v!r}") from None

    @property
    def tree_nodes(self) -> int:
        """Draft nodes of the full tree shape (branching ** 1 + ... + branching ** draft_len); draft_len for a chain."""
        return sum(self.branching ** d for d in range(1, self.draft_len + 1))

    @property
    def shape(self) -> str:
        return str(self.draft_len) if self.branching == 1 else f"{self.branching}x{self.draft_len}"

    def validate(self) -> None:
        for name in ("draft_len", "branching", "ngram_max", "ngram_min", "lookup"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"speculative.{name}: expected an integer, got {type(v).__name__} ({v!r})")
        if not 1 <= self.draft_len <= MAX_DRAFT_LEN:
            raise ValueError(f"speculative.draft_len: must be in [1, {MAX_DRAFT_LEN}] (the verify pass holds the "
                             f"pending token plus the draft in at most {MAX_DRAFT_LEN + 1} positions), "
                             f"got {self.draft_len}")
        if self.branching < 1:
            raise ValueError(f"speculative.branching: must be >= 1 (1 = a chain), got {self.branching}")
        if self.branching > 1 and self.tree_nodes > MAX_TREE_NODES:
            raise ValueError(f"speculative.branching/draft_len: a {self.shape} token tree has {self.tree_nodes} draft "
                             f"nodes; the verify pass holds the pending token plus at most {MAX_TREE_NODES} nodes "
                             f"(e.g. 2x3 = 14, 3x2 = 12, 15x1 = 15)")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"speculative.ngram_min/ngram_max: need 1 <= ngram_min <= ngram_max, got "
                             f"{self.ngram_min}, {self.ngram_max}")
        if not 0 <= self.lookup <= self.ngram_max:
            raise ValueError(f"speculative.lookup: the shortest suffix prompt lookup trusts beside the trained head "
                             f"must be in [1, ngram_max = {self.ngram_max}], or 0 (the head alone); got {self.lookup}")
        if self.drafter_path is not None and not isinstance(self.drafter_path, str):
            raise ValueError(f"speculative.drafter_path: expected a str path, got {type(self.drafter_path).__name__}")

    @staticmethod
    def parse(text: str) -> "SpecConfig | None":
        """'off' | 'METHOD[:SHAPE[:VERIFY[:ACCEPTANCE]]]' with SHAPE a chain's draft length ('3') or a token tree
        'BxD' (top-B branching at each of D depths: '2x3'), e.g. 'ngram:3', 'drafter:2x3:exact:match'."""
        if not isinstance(text, str):
            raise ValueError(f"speculative: expected a string like 'ngram:3' or 'off', got {type(text).__name__}")
        if text.strip().lower() in ("", "off", "none"):
            return None
        parts = text.strip().split(":")
        if len(parts) > 4:
            raise ValueError(f"speculative: expected 'METHOD[:SHAPE[:VERIFY[:ACCEPTANCE]]]', got {text!r}")
        kw: dict = {"method": parts[0]}
        if len(parts) > 1:
            shape = parts[1].lower().split("x")
            try:
                if len(shape) == 1:
                    kw["draft_len"] = int(shape[0])
                elif len(shape) == 2:
                    kw["branching"], kw["draft_len"] = int(shape[0]), int(shape[1])
                else:
                    raise ValueError
            except ValueError:
                raise ValueError(f"speculative: draft length {parts[1]!r} in {text!r} is not an integer (a chain: "
                                 f"'3') or a tree shape 'BxD' ('2x3')") from None
        if len(parts) > 2:
            kw["verify"] = parts[2]
        if len(parts) > 3:
            kw["acceptance"] = parts[3]
        cfg = SpecConfig(**kw)
        cfg.validate()
        return cfg
