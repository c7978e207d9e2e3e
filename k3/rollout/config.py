"""Launch settings of the embedded engine (a typed frozen config), how prompts are matched against the prefix
cache, and the error a failed call raises."""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from k3.rollout.spec.config import SpecConfig
from k3.rollout.types import MAX_SEGMENT


class PrefixMatch(str, enum.Enum):
    """How a prompt is matched against the prefix cache.

    EXACT: by key (token + how it was computed). Reuse is bitwise exact (cache on == cache off), but history only
      matches when it comes back as the engine's own `Prompt` spans (`Completion.extend`).
    TOKENS: by token ids alone, for clients that re-send each conversation as one flat token list (OpenAI-style
      clients of SGLang and vLLM do). A flat prompt reuses whatever of its prefix is cached, decode-produced
      states included, and computes the rest from there. The price: reused history was computed token by token
      (decode) where a fresh computation of the flat prompt would prefill it in chunks, so the outputs differ
      from recomputation by rounding (the log-prob difference is measured in benchmarks/prefix_match.py).
    """
    EXACT = "exact"
    TOKENS = "tokens"


@dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16            # MLA tokens per page
    chunk_size: int = 64           # prefill chunk (absolute alignment)
    checkpoint_interval: int = 256  # KDA checkpoint every this many tokens (multiple of chunk_size)
    decode_batch: int = 8          # fixed decode batch size (dummy rows fill it)
    prefill_batch: int = 1         # prefill segments at one (position, length) per forward (dummy rows fill it)
    max_step_tokens: int = 256     # tokens per engine step (decode rows first, then prefill chunks)
    max_running: int = 32          # running samples
    device_pages: int = 4096
    host_pages: int = 4096
    device_states: int = 64
    host_states: int = 64
    seed: int = 0                  # seeds requests that give none
    prefix_match: PrefixMatch = PrefixMatch.EXACT
    speculative: SpecConfig | None = None   # speculative decoding (k3.rollout.spec); a str like "ngram:3" is parsed
    cuda_graphs: bool = True       # decode steps as captured CUDA graphs on a CUDA engine (k3.rollout.graphs)

    def __post_init__(self) -> None:
        if isinstance(self.speculative, str):
            object.__setattr__(self, "speculative", SpecConfig.parse(self.speculative))
        if not isinstance(self.prefix_match, PrefixMatch):
            try:
                object.__setattr__(self, "prefix_match", PrefixMatch(self.prefix_match))
            except ValueError:
                raise ValueError(f"prefix_match: must be one of {[m.value for m in PrefixMatch]}, "
                                 f"got {self.prefix_match!r}") from None

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("prefix_match", "speculative"):
                continue
            if f.name == "cuda_graphs":
                if not isinstance(v, bool):
                    raise ValueError(f"cuda_graphs: expected a bool, got {type(v).__name__} ({v!r})")
                continue
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{f.name}: expected an integer, got {type(v).__name__} ({v!r})")
        for name in ("page_size", "chunk_size", "checkpoint_interval", "decode_batch", "prefill_batch",
                     "max_step_tokens", "max_running", "device_pages", "device_states"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("host_pages", "host_states", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.chunk_size > MAX_SEGMENT:
            raise ValueError(f"chunk_size: must be <= {MAX_SEGMENT} (segment lengths live in 10 key bits), "
                             f"got {self.chunk_size}")
        if self.checkpoint_interval % self.chunk_size:
            raise ValueError(f"checkpoint_interval: {self.checkpoint_interval} must be a multiple of chunk_size "
                             f"{self.chunk_size} (checkpoints sit at segment ends)")
        if self.speculative is not None:
            if not isinstance(self.speculative, SpecConfig):
                raise ValueError(f"speculative: expected a SpecConfig, a string like 'ngram:3', or None, got "
                                 f"{type(self.speculative).__name__}")
            self.speculative.validate()
        if self.max_step_tokens < self.chunk_size:
            raise ValueError(f"max_step_tokens: {self.max_step_tokens} must be >= chunk_size {self.chunk_size}")


class RequestFailed(RuntimeError):
    """An exception inside `generate` after admission. Every sequence of that call was finished and released
    (pages, states, tree pins) before this was raised: the engine is consistent and serves the next call."""
