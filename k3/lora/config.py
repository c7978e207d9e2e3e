"""LoRA configuration and target selection for K3.

A target is a projection that can carry a rank-r adapter:
  * an `nn.Linear` inside `model.layers` (MLA q/kv/o/g, KDA q/k/v/f_a/f_b/b/g/o, dense MLP, shared experts, the
    latent MoE down/up projections), named by its module path, e.g. `model.layers.3.self_attn.kv_b_proj`;
  * a stacked routed-expert weight `...block_sparse_moe.experts.w1|w2|w3` ([E, out, in]): one adapter per expert.

Targets are chosen by patterns: a group name from `TARGET_GROUPS`, a glob (fnmatch) matched against the full
name or any dot-suffix of it (`self_attn.o_proj` matches every layer's o_proj), or a regular expression written
`re:<regex>` (full match). Each pattern (or group, as a whole) must select at least one target.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

from torch import nn

from k3.model.moe import RoutedExperts

# Names follow the kimi_linear checkpoint; MLA and KDA share q_proj/o_proj/g_proj names.
TARGET_GROUPS: dict[str, tuple[str, ...]] = {
    "attn": (
        "self_attn.q_proj", "self_attn.q_a_proj", "self_attn.q_b_proj",            # MLA q (full or low-rank), KDA q
        "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj",                      # MLA kv
        "self_attn.k_proj", "self_attn.v_proj",                                     # KDA k, v
        "self_attn.f_a_proj", "self_attn.f_b_proj", "self_attn.b_proj",             # KDA decay gate, beta
        "self_attn.g_proj", "self_attn.g_a_proj", "self_attn.g_b_proj",             # output gates
        "self_attn.o_proj",
    ),
    "mlp": (
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",                            # dense layers
        "shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj",
    ),
    "experts": ("experts.w1", "experts.w2", "experts.w3"),                          # routed experts (stacked)
}
DEFAULT_TARGETS: tuple[str, ...] = ("attn", "mlp")
# Default rank per model preset (K3: 64, the figure; the small presets get proportionally smaller ranks).
PRESET_RANKS: dict[str, int] = {"k3": 64, "small": 16, "tiny": 8}


@dataclass(frozen=True)
class LoRAConfig:
    """rank r, alpha (the adapter output is scaled by alpha / r), target patterns (see module doc)."""

    rank: int = 64
    alpha: float = 32.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    init_scale: float = 0.0  # std of B at creation; 0 (the usual LoRA init) makes a new adapter a no-op

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"rank must be a positive integer, got {self.rank!r}")
        if not float(self.alpha) > 0:
            raise ValueError(f"alpha must be positive, got {self.alpha!r}")
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", (self.targets,))
        object.__setattr__(self, "targets", tuple(self.targets))
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise ValueError(f"targets must be a non-empty sequence of patterns, got {self.targets!r}")
        if self.init_scale < 0:
            raise ValueError(f"init_scale must be >= 0, got {self.init_scale}")

    @property
    def scaling(self) -> float:
        return float(self.alpha) / self.rank

    @classmethod
    def preset(cls, name: str, **changes) -> "LoRAConfig":
        """The default LoRA for a K3 model preset (rank 64 for "k3", 8 for "tiny")."""
        if name not in PRESET_RANKS:
            raise ValueError(f"preset: unknown {name!r}; choose from {sorted(PRESET_RANKS)}")
        return cls(**{"rank": PRESET_RANKS[name], **changes})

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": float(self.alpha), "targets": list(self.targets),
                "init_scale": float(self.init_scale)}

    @classmethod
    def from_dict(cls, d: dict) -> "LoRAConfig":
        return cls(rank=int(d["rank"]), alpha=float(d["alpha"]), targets=tuple(d["targets"]),
                   init_scale=float(d.get("init_scale", 0.0)))


@dataclass(frozen=True)
class Target:
    """One adaptable weight: `kind` "linear" (weight [out, in]) or "experts" (stacked [E, out, in])."""

    name: str
    kind: str
    in_features: int
    out_features: int
    num_experts: int = 0
    param: str = field(default="weight")  # the parameter's attribute on its module (weight, w1, w2, w3)

    @property
    def module_name(self) -> str:
        return self.name if self.kind == "linear" else self.name.rsplit(".", 1)[0]

    @property
    def weight_name(self) -> str:
        """The weight's key in the model's state dict."""
        return f"{self.name}.weight" if self.kind == "linear" else self.name

    def a_shape(self, rank: int) -> tuple[int, ...]:
        return (rank, self.in_features) if self.kind == "linear" else (self.num_experts, rank, self.in_features)

    def b_shape(self, rank: int) -> tuple[int, ...]:
        return (self.out_features, rank) if self.kind == "linear" else (self.num_experts, self.out_features, rank)


def candidate_targets(model: nn.Module) -> dict[str, Target]:
    """Every weight of `model` that can carry an adapter: Linear layers and stacked experts under model.layers."""
    out: dict[str, Target] = {}
    for name, mod in model.named_modules():
        if ".layers." not in f".{name}":
            continue
        if isinstance(mod, nn.Linear):
            out[name] = Target(name, "linear", mod.in_features, mod.out_features)
        elif isinstance(mod, RoutedExperts):
            for p in ("w1", "w3", "w2"):
                w = getattr(mod, p)
                out[f"{name}.{p}"] = Target(f"{name}.{p}", "experts", w.shape[2], w.shape[1], w.shape[0], p)
    return out


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


def resolve_targets(model: nn.Module, patterns: tuple[str, ...] | list[str]) -> dict[str, Target]:
    """The targets of `model` selected by `patterns` (groups, globs, `re:` regexes), in model order.

    Raises ValueError naming any pattern (or group) that selects nothing, or an invalid regex."""
    cands = candidate_targets(model)
    chosen: set[str] = set()
    for pat in patterns:
        members = TARGET_GROUPS.get(pat, (pat,))
        if pat.startswith("re:"):
            try:
                re.compile(pat[3:])
            except re.error as e:
                raise ValueError(f"targets: invalid regex {pat!r}: {e}") from None
        hit = {n for n in cands for m in members if _matches(m, n)}
        if not hit:
            sample = ", ".join(list(cands)[:4])
            raise ValueError(f"targets: pattern {pat!r} matches no adaptable weight (names look like {sample}, ...)")
        chosen |= hit
    return {n: t for n, t in cands.items() if n in chosen}
