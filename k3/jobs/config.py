"""The main job's configuration: a TOML file of sections, every field typed and checked. An unknown section or
field, a wrong type or an out-of-range value is a `JobConfigError` naming `section.field`."""
from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class JobConfigError(ValueError):
    pass


@dataclass
class ModelSection:
    preset: str = "tiny"
    seed: int = 0


@dataclass
class SFTSection:
    """Warm start on synthetic demonstrations with deliberate mistakes (see k3.envs.calc_task)."""
    cache_dir: str = ".cache/k3"
    steps: int = 500
    batch_size: int = 32
    lr: float = 3e-3
    p_tool: float = 0.25         # share of demonstrations that decide to call the tool (others answer "from the head")
    p_slip: float = 0.2          # share of tool-using demonstrations with a garbled call or copied result
    p_copy: float = 0.5          # share of rows that teach the tool's mechanics only (decision token not trained)
    seed: int = 1


@dataclass
class RolloutSection:
    tasks_per_update: int = 16
    group_size: int = 8
    max_turn_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    prefix_cache: bool = True
    checkpoint_every: int = 64
    state_slots: int = 512       # KDA state slots (device tier; as many again on the host tier)
    kv_pages: int = 8192         # MLA latent pages of 16 tokens (device tier; as many again on the host tier)


@dataclass
class RLSection:
    mode: str = "lora"           # "lora" or "full"
    lr: float = 2e-3
    lora_rank: int = 8
    lora_alpha: float = 16.0
    eps_low: float = 3e-4
    eps_high: float = 4e-4
    router_replay: bool = True
    kl_coef: float = 0.0
    max_grad_norm: float = 1.0
    micro_batch_size: int = 16   # sequences per learner forward/backward (the update's gradient is accumulated)
    train_seed: int = 7


@dataclass
class SyncSection:
    full_every: int = 25
    zstd_level: int = 3


@dataclass
class EvalSection:
    every: int = 5
    heldout: int = 50
    samples: int = 4             # sampled episodes per held-out task (the mean estimates the expected reward)


@dataclass
class JobConfig:
    model: ModelSection = field(default_factory=ModelSection)
    sft: SFTSection = field(default_factory=SFTSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    rl: RLSection = field(default_factory=RLSection)
    sync: SyncSection = field(default_factory=SyncSection)
    eval: EvalSection = field(default_factory=EvalSection)
    updates: int = 20

    def validate(self) -> None:
        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise JobConfigError(f"{name}: {msg}")

        from k3.config import PRESETS
        need(self.model.preset in PRESETS, "model.preset", f"unknown preset {self.model.preset!r}")
        need(self.updates >= 1, "updates", "must be >= 1")
        for sec, names in (("sft", ("steps", "batch_size")), ("rollout", ("tasks_per_update", "group_size",
                           "max_turn_tokens", "checkpoint_every", "state_slots", "kv_pages")), ("rl", ("lora_rank", "micro_batch_size")),
                           ("sync", ("full_every",)), ("eval", ("every", "heldout", "samples"))):
            for n in names:
                need(getattr(getattr(self, sec), n) >= 1, f"{sec}.{n}", "must be >= 1")
        need(self.rollout.group_size >= 2, "rollout.group_size", "GSPO needs >= 2 samples per task")
        need(self.sft.lr > 0 and self.rl.lr > 0, "rl.lr" if self.rl.lr <= 0 else "sft.lr", "must be positive")
        need(0.0 <= self.sft.p_tool <= 1.0, "sft.p_tool", "must be in [0, 1]")
        need(0.0 <= self.sft.p_slip <= 1.0, "sft.p_slip", "must be in [0, 1]")
        need(0.0 <= self.sft.p_copy <= 1.0, "sft.p_copy", "must be in [0, 1]")
        need(self.rollout.temperature > 0, "rollout.temperature", "must be positive")
        need(0.0 < self.rollout.top_p <= 1.0, "rollout.top_p", "must be in (0, 1]")
        need(self.rollout.top_k >= 0, "rollout.top_k", "must be >= 0 (0 = off)")
        need(self.rl.mode in ("lora", "full"), "rl.mode", f"must be 'lora' or 'full', got {self.rl.mode!r}")
        need(self.rl.kl_coef >= 0, "rl.kl_coef", "must be >= 0")
        need(1 <= self.sync.zstd_level <= 22, "sync.zstd_level", "must be in [1, 22]")
        need(1 <= self.eval.heldout <= 50, "eval.heldout", "the held-out set has 50 tasks")


def _build(cls, data: dict[str, Any], prefix: str):
    fields_ = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if key not in fields_:
            raise JobConfigError(f"{name}: unknown field (known: {', '.join(sorted(fields_))})")
        f = fields_[key]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            if not isinstance(value, dict):
                raise JobConfigError(f"{name}: expected a [{key}] table")
            kwargs[key] = _build(type(default), value, f"{name}.")
            continue
        want = type(default)
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not want:
            raise JobConfigError(f"{name}: expected {want.__name__}, got {type(value).__name__} ({value!r})")
        kwargs[key] = value
    return cls(**kwargs)


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> JobConfig:
    """Defaults, then the TOML file (if any), then `overrides` ({"updates": 3, "rl.lr": 1e-3}); validated."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise JobConfigError(f"config: {p} does not exist")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise JobConfigError(f"config: {p} is not valid TOML: {e}") from e
    for key, value in (overrides or {}).items():
        *sections, leaf = key.split(".")
        d = data
        for s in sections:
            d = d.setdefault(s, {})
        d[leaf] = value
    cfg = _build(JobConfig, data, "")
    cfg.validate()
    return cfg
