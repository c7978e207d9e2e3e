"""What the engine tracks per request and per running sample (one `RunningSeq` per sample of a request)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3.rollout.types import Completion, Prompt, SamplingParams


@dataclass(eq=False)
class GenRequest:
    rid: int
    prompt: Prompt
    key: list[int]
    params: SamplingParams
    seed: int
    scope: tuple
    version: int
    samples: list["RunningSeq"] = field(default_factory=list)
    done: list[Completion | None] = field(default_factory=list)
    hit: int = 0


@dataclass(eq=False)
class RunningSeq:
    req: GenRequest
    index: int
    key: list[int]                 # fed key elements [0, pos) + pending ones
    pos: int
    bt: list[int]                  # page ids for positions [0, pos) (+ the page being written)
    state: int
    gen: torch.Generator
    branch_at: set[int] = field(default_factory=set)
    out_tokens: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    out_slogprobs: list[float] = field(default_factory=list)
    out_routing: list[torch.Tensor] = field(default_factory=list)
    sampling: bool = False         # past the prompt: logits at the end of each step are sampled
    unpinned: set[int] = field(default_factory=set)  # pages of `bt` retained but not pinned yet (admission)

    @property
    def pending(self) -> int:
        return len(self.key) - self.pos
