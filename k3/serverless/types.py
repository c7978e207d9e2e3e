"""The Tinker-shaped data types of the service (client and server share them; plain dataclasses, JSON on the wire).

    Datum(model_input=ModelInput.from_ints(tokens), loss_fn_inputs={"target_tokens": [...], "logprobs": [...],
          "advantages": [...], "weights": [...]})

Position i of `model_input` predicts `target_tokens[i]` (Tinker's convention): every `loss_fn_inputs` list has the
model input's length. `weights` (default all 1) is the per-token weight of every loss and, for the RL losses, the
token mask (weight 0 = not trained: prompt and tool-output tokens)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

LOSS_FNS: tuple[str, ...] = ("cross_entropy", "importance_sampling", "ppo", "gspo", "cispo", "logprob_linear")
# the loss_fn_inputs each loss reads (weights and routed_experts are optional everywhere)
LOSS_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens",),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "gspo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "logprob_linear": ("target_tokens", "logprob_grads"),   # forward_backward_custom's second half
}
FLOAT_INPUTS = ("logprobs", "advantages", "weights", "logprob_grads")
# routed_experts: per model_input position, the expert ids [n_moe_layers][top_k] the sampler routed that position
# to (Router Replay: forward_backward routes through them); a position's ids in a layer all -1 = route freely
INPUT_NAMES = ("target_tokens",) + FLOAT_INPUTS + ("routed_experts",)


class ServiceError(RuntimeError):
    """A refused or failed call: `status` is the HTTP status (4xx: the request; 5xx: the server), `detail` names
    the offending field."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"{status}: {detail}")
        self.status, self.detail = status, detail


@dataclass(frozen=True)
class ModelInput:
    tokens: tuple[int, ...]

    @classmethod
    def from_ints(cls, tokens) -> "ModelInput":
        return cls(tuple(int(t) for t in tokens))

    def to_ints(self) -> list[int]:
        return list(self.tokens)

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class Datum:
    model_input: ModelInput
    loss_fn_inputs: dict[str, list] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"model_input": list(self.model_input.tokens),
                "loss_fn_inputs": {k: [[[int(e) for e in layer] for layer in x] for x in v] if k == "routed_experts"
                                   else [float(x) if k in FLOAT_INPUTS else int(x) for x in v]
                                   for k, v in self.loss_fn_inputs.items()}}


@dataclass(frozen=True)
class AdamParams:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0   # 0: no clipping

    def validate(self, where: str = "adam_params") -> None:
        for name, ok, why in (("learning_rate", lambda v: v > 0, "must be > 0"),
                              ("beta1", lambda v: 0 <= v < 1, "must be in [0, 1)"),
                              ("beta2", lambda v: 0 <= v < 1, "must be in [0, 1)"),
                              ("eps", lambda v: v > 0, "must be > 0"),
                              ("weight_decay", lambda v: v >= 0, "must be >= 0"),
                              ("grad_clip_norm", lambda v: v >= 0, "must be >= 0 (0 = off)")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
                raise ValueError(f"{where}.{name}: {why} and finite, got {v!r}")

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[int, ...] = ()    # stop token ids (kept in the output)

    def to_json(self) -> dict:
        d = asdict(self)
        d["stop"] = list(self.stop)
        return d


@dataclass(frozen=True)
class SampledSequence:
    """`routed_experts[i]` ([n_moe_layers][top_k], when asked for) is the routing of the position whose logits
    produced tokens[i] (the last prompt position for i = 0): what Router Replay feeds back."""
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    routed_experts: list | None = None


@dataclass(frozen=True)
class SampleResponse:
    sequences: list[SampledSequence]


@dataclass(frozen=True)
class ForwardBackwardOutput:
    """Per datum: the trainer's log-probs of its target tokens (`loss_fn_outputs[i]["logprobs"]`); `metrics`
    (loss and the loss's own metrics, summed over this call's data)."""
    loss_fn_outputs: list[dict[str, list[float]]]
    metrics: dict[str, float]


@dataclass(frozen=True)
class OptimStepOutput:
    step: int
    metrics: dict[str, float]


def datum_from_json(d: Any, where: str) -> Datum:
    """A Datum from its wire form; ValueError naming `where.<field>` for anything malformed."""
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected an object with model_input and loss_fn_inputs")
    unknown = set(d) - {"model_input", "loss_fn_inputs"}
    if unknown:
        raise ValueError(f"{where}.{sorted(unknown)[0]}: unknown field")
    toks = d.get("model_input")
    if not isinstance(toks, list) or not toks or not all(isinstance(t, int) and not isinstance(t, bool)
                                                          for t in toks):
        raise ValueError(f"{where}.model_input: expected a non-empty list of token ids")
    inputs = d.get("loss_fn_inputs", {})
    if not isinstance(inputs, dict):
        raise ValueError(f"{where}.loss_fn_inputs: expected an object")
    out: dict[str, list] = {}
    for k, v in inputs.items():
        w = f"{where}.loss_fn_inputs.{k}"
        if k not in INPUT_NAMES:
            raise ValueError(f"{w}: unknown input (known: {list(INPUT_NAMES)})")
        if not isinstance(v, list) or len(v) != len(toks):
            raise ValueError(f"{w}: expected a list of {len(toks)} values (one per model_input token), got "
                             f"{len(v) if isinstance(v, list) else type(v).__name__}")
        if k == "target_tokens":
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
                raise ValueError(f"{w}: expected integer token ids")
        elif k == "routed_experts":
            if not all(isinstance(x, list) and all(isinstance(layer, list) and all(
                    isinstance(e, int) and not isinstance(e, bool) for e in layer) for layer in x) for x in v):
                raise ValueError(f"{w}: expected per position a list of layers, each a list of integer expert ids")
        elif not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v):
            raise ValueError(f"{w}: expected finite numbers")
        out[k] = list(v)
    return Datum(ModelInput(tuple(toks)), out)
