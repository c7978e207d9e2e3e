"""`k3 serve` launch settings: one typed frozen config (TOML file sections map onto it; unknown or mistyped
fields are refused naming the field)."""
from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from k3.rollout import EngineConfig


def engine_defaults(device: str) -> EngineConfig:
    """The service's engine on `device` ('cpu' or 'cuda'). Both: the prefix cache spills KV pages and KDA states to
    a host tier as large as the device one. On CUDA, concurrent sessions' requests meet in the engine: decode steps
    of 64 rows and prefill forwards of 8 segments (a GEMM of fixed shape gives a row the same bits wherever it sits,
    so every session's tokens stay those it gets alone), up to 1024 tokens a step; on the H200 these took the 8-client
    load test from 1.50x to 3.92x one-after-another (k3/serverless/NOTES.md). On CPU the padded rows would cost
    compute, so decode and prefill keep the engine's own defaults."""
    base = EngineConfig(chunk_size=32, checkpoint_interval=64, max_running=64, device_pages=2048, host_pages=2048,
                        device_states=128, host_states=128)
    if device == "cuda":
        return dataclasses.replace(base, decode_batch=64, prefill_batch=8, max_step_tokens=1024)
    return base


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"          # loopback unless told otherwise
    port: int = 8000
    base_model: str = "k3-tiny"      # the name clients pass as create_lora_training_client(base_model=...)
    preset: str = "tiny"             # K3Config preset of a randomly initialised base (when base_dir is empty)
    device: str = "auto"             # auto (cuda when available), cpu or cuda
    model_seed: int = 0
    base_dir: str = ""               # a saved K3ForCausalLM (e.g. the main job's SFT base) instead of the preset
    data_dir: str = "runs/serve"     # SQLite + safetensors
    max_rank: int = 128
    lora_targets: tuple[str, ...] = ("attn", "mlp")
    max_data: int = 64               # data per forward / forward_backward call
    max_seq_len: int = 512           # tokens per datum / prompt
    max_num_samples: int = 64        # samples per sample call
    max_sample_tokens: int = 256
    max_sessions: int = 64
    max_loaded_samplers: int = 64    # sampler snapshots held in the manager at once (others hot-load on use)
    length_bucket: int = 32          # rows are padded to a multiple of this (see k3.serverless.compute)
    max_batch_rows: int = 64         # rows in one packed forward/backward (bounds the autograd memory)
    offload_after: int = 4           # scheduler rounds without a session's request before its optimizer state moves to host
    max_skips: int = 2               # rounds a waiting session may be passed over for locality before it goes first
    batch_wait_ms: int = 50          # a batched round waits up to this long for more sessions' requests of its kind
                                     # (only for sessions served lately that can still send: a lone session never waits)
    keep_samplers: int = 8           # sampler snapshots kept per session (older ones and their files are removed)
    create_key_sha256: str = ""      # if set, creating a session needs the key whose SHA-256 this is
    # None: the resolved device's defaults (`engine_defaults`); a TOML [engine] table overrides fields of those
    engine: EngineConfig | None = None

    def resolved_device(self) -> str:
        """'cuda' or 'cpu': what `device` ('auto' included) names on this machine."""
        if self.device != "auto":
            return self.device
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"

    def engine_config(self) -> EngineConfig:
        """The engine settings the service runs with: `engine` if given, else the device's defaults."""
        return self.engine if self.engine is not None else engine_defaults(self.resolved_device())

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "engine":
                if v is None:
                    continue
                try:
                    v.validate()
                except ValueError as e:
                    raise ValueError(f"engine.{e}") from None
                continue
            if f.name == "lora_targets":
                if not v or not all(isinstance(x, str) and x for x in v):
                    raise ValueError(f"lora_targets: expected a non-empty list of patterns, got {v!r}")
                continue
            want = int if f.type in ("int", int) else str
            if isinstance(v, bool) or not isinstance(v, want):
                raise ValueError(f"{f.name}: expected {want.__name__}, got {type(v).__name__} ({v!r})")
            if want is int and f.name not in ("model_seed", "batch_wait_ms") and v < 1:
                raise ValueError(f"{f.name}: must be >= 1, got {v}")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port: must be in [1, 65535], got {self.port}")
        if self.max_rank > 128:
            raise ValueError(f"max_rank: at most 128 is supported, got {self.max_rank}")
        if self.model_seed < 0:
            raise ValueError(f"model_seed: must be >= 0, got {self.model_seed}")
        if not 0 <= self.batch_wait_ms <= 1000:
            raise ValueError(f"batch_wait_ms: must be in [0, 1000], got {self.batch_wait_ms}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device: expected 'auto', 'cpu' or 'cuda', got {self.device!r}")

    @classmethod
    def from_toml(cls, path: str | Path | None, **overrides) -> "ServeConfig":
        """Fields from a TOML file (top-level keys; an [engine] table for EngineConfig), then `overrides`."""
        raw = tomllib.loads(Path(path).read_text()) if path else {}
        raw.update({k: v for k, v in overrides.items() if v is not None})
        known = {f.name for f in dataclasses.fields(cls)}
        for k in raw:
            if k not in known:
                raise ValueError(f"{k}: unknown setting (known: {sorted(known)})")
        if "engine" in raw:
            eng = raw["engine"]
            eknown = {f.name for f in dataclasses.fields(EngineConfig)}
            bad = [k for k in eng if k not in eknown]
            if bad:
                raise ValueError(f"engine.{bad[0]}: unknown setting")
            raw["engine"] = dataclasses.replace(cls(device=raw.get("device", "auto")).engine_config(), **eng)
        if "lora_targets" in raw:
            raw["lora_targets"] = tuple(raw["lora_targets"])
        cfg = cls(**raw)
        cfg.validate()
        return cfg
