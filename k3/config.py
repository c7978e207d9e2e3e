"""K3Config: the published Kimi K3 text config (`kimi_linear` inside `kimi_k3`) plus small presets.

Field names follow the published `config.json` so a real checkpoint's config loads unchanged.
Layer lists in `linear_attn_config` are 1-based, as published.

Two ways in, two strictness levels:
* `K3Config(...)` / `.replace(...)` / presets: every field has the published K3 value as its default, so code can
  say "K3, but 8 layers". Types and ranges are still checked (`validate`).
* `from_dict` / `from_pretrained` read a config someone wrote: every field that fixes a tensor's shape, whether a
  weight exists, or which layers are KDA/MLA/MoE must be stated (`REQUIRED_FIELDS`, `REQUIRED_LINEAR_ATTN_KEYS`),
  so a forgotten `hidden_size` is an error instead of a silent 7168; unknown keys are errors (a misspelt field
  would otherwise be ignored) except Hugging Face's metadata (`HF_METADATA_KEYS`).
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A K3 config field is missing or inconsistent; the message names the field."""


#: Fields `from_dict` requires: each fixes a tensor's shape, whether a weight exists, or which layers are
#: KDA/MLA/dense/MoE, so a default here would silently build (or load into) a different network. The rest
#: (norm eps, token ids, router numerics, SiTU betas, ...) default to the published K3 values.
REQUIRED_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "tie_word_embeddings",
    "linear_attn_config",
    # Gated MLA
    "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "mla_use_output_gate",
    # Latent MoE (not required of a dense config: num_experts 0 or null)
    "num_experts", "num_experts_per_token", "num_shared_experts", "moe_intermediate_size",
    "routed_expert_hidden_size", "latent_moe_use_norm", "first_k_dense_replace", "moe_layer_freq",
    # Block Attention Residuals (null = none; its weights exist only when set)
    "attn_res_block_size",
)
MOE_ONLY_FIELDS = frozenset({"num_experts_per_token", "num_shared_experts", "moe_intermediate_size",
                             "routed_expert_hidden_size", "latent_moe_use_norm", "first_k_dense_replace",
                             "moe_layer_freq"})
#: `linear_attn_config` keys `from_dict` requires (all the keys K3 publishes): layer lists, head count and size,
#: conv width and full-rank gate fix shapes; `gate_lower_bound` picks the gate (null = the default, unsafe gate).
REQUIRED_LINEAR_ATTN_KEYS = ("kda_layers", "full_attn_layers", "num_heads", "head_dim", "short_conv_kernel_size",
                             "gate_lower_bound", "use_full_rank_gate")
#: Allowed types of each `linear_attn_config` key (no other key is accepted).
LINEAR_ATTN_TYPES: dict[str, tuple[type, ...]] = {
    "kda_layers": (list, tuple), "full_attn_layers": (list, tuple), "num_heads": (int,), "head_dim": (int,),
    "short_conv_kernel_size": (int,), "gate_lower_bound": (float, type(None)), "use_full_rank_gate": (bool,),
}
#: Keys of a published text config that `from_dict` reads and ignores: Hugging Face's serialisation metadata, and
#: published K3 fields with no effect on this model (MLA: one KV latent, so `num_key_value_heads` is moot; NoPE,
#: so the rope settings are unused; grouped top-k is `num_expert_group`/`topk_group`; `num_nextn_predict_layers`
#: must be 0, which from_dict checks). Anything else unknown is an error naming the key.
HF_METADATA_KEYS = frozenset({
    "architectures", "auto_map", "model_type", "torch_dtype", "dtype", "transformers_version", "_name_or_path",
    "quantization_config", "use_cache", "initializer_range", "rope_theta", "rope_scaling", "num_key_value_heads",
    "use_grouped_topk", "num_nextn_predict_layers",
})
#: Published spellings of our fields (DeepSeek-style names some configs use).
FIELD_ALIASES = {"n_routed_experts": "num_experts", "num_experts_per_tok": "num_experts_per_token"}


@dataclass
class K3Config:
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    intermediate_size: int = 33792
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    bos_token_id: int = 163584
    eos_token_id: int = 163586
    pad_token_id: int = 163839
    # KDA (linear attention); kda_layers / full_attn_layers are 1-based.
    linear_attn_config: dict = field(default_factory=dict)
    # Gated MLA
    num_attention_heads: int = 96
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    # Latent MoE
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int | None = 3584
    latent_moe_use_norm: bool = True
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    moe_renormalize: bool = True
    moe_router_activation_func: str = "sigmoid"
    routed_scaling_factor: float = 1.0
    topk_method: str = "noaux_tc"
    num_expert_group: int = 1
    topk_group: int = 1
    # SiTU
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    # Block Attention Residuals: block size counts decoder layers (K3 convention).
    attn_res_block_size: int | None = 12

    def __post_init__(self) -> None:
        if self.linear_attn_config is not None and not isinstance(self.linear_attn_config, dict):
            raise ConfigError(_type_message("linear_attn_config", self.linear_attn_config, (dict,)))
        self.linear_attn_config = {**_default_linear_attn(self.num_hidden_layers), **(self.linear_attn_config or {})}
        self.validate()

    # ------------------------------------------------------------------ derived
    @property
    def kda_num_heads(self) -> int:
        return int(self.linear_attn_config["num_heads"])

    @property
    def kda_head_dim(self) -> int:
        return int(self.linear_attn_config["head_dim"])

    @property
    def conv_kernel_size(self) -> int:
        return int(self.linear_attn_config.get("short_conv_kernel_size", 4))

    @property
    def gate_lower_bound(self) -> float | None:
        lb = self.linear_attn_config.get("gate_lower_bound")
        return None if lb is None else float(lb)

    @property
    def latent_size(self) -> int:
        return self.routed_expert_hidden_size or self.hidden_size

    def is_kda_layer(self, layer_idx: int) -> bool:
        """0-based layer index -> True for a KDA layer, False for MLA."""
        return (layer_idx + 1) in set(self.linear_attn_config["kda_layers"])

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.num_experts > 0
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"{name}: {msg}")

        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name), _allowed_types(_FIELD_TYPES[f.name]))
        lac = self.linear_attn_config
        for key, value in lac.items():
            if key not in LINEAR_ATTN_TYPES:
                raise ConfigError(f"linear_attn_config.{key}: {_unknown(key, LINEAR_ATTN_TYPES)}")
            _check_type(f"linear_attn_config.{key}", value, LINEAR_ATTN_TYPES[key])

        n = self.num_hidden_layers
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                     "v_head_dim", "intermediate_size"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) > 0, name, "must be a positive integer")
        kda = list(lac.get("kda_layers") or [])
        full = list(lac.get("full_attn_layers") or [])
        for name, layers in (("linear_attn_config.kda_layers", kda), ("linear_attn_config.full_attn_layers", full)):
            bad = [x for x in layers if isinstance(x, bool) or not isinstance(x, int) or not 1 <= x <= n]
            need(not bad, name, f"layer ids are 1-based in [1, {n}]; got {bad}")
            need(len(set(layers)) == len(layers), name, "has duplicate layer ids")
        overlap = sorted(set(kda) & set(full))
        need(not overlap, "linear_attn_config", f"kda_layers and full_attn_layers overlap at {overlap}")
        missing = sorted(set(range(1, n + 1)) - set(kda) - set(full))
        need(not missing, "linear_attn_config", f"layers {missing} are neither in kda_layers nor full_attn_layers")
        need(int(lac.get("num_heads", 0)) > 0, "linear_attn_config.num_heads", "must be positive")
        hd = int(lac.get("head_dim", 0))
        need(hd > 0 and hd <= 256, "linear_attn_config.head_dim", f"must be in (0, 256] (KDA kernels), got {hd}")
        need(int(lac.get("short_conv_kernel_size", 4)) >= 1, "linear_attn_config.short_conv_kernel_size", "must be >= 1")
        lb = lac.get("gate_lower_bound")
        need(lb is None or -5.0 <= float(lb) < 0.0, "linear_attn_config.gate_lower_bound",
             f"must be in [-5, 0) (safe gate), got {lb}")
        need(self.qk_nope_head_dim >= 0 and self.qk_rope_head_dim >= 0 and self.qk_nope_head_dim + self.qk_rope_head_dim > 0,
             "qk_nope_head_dim", "qk_nope_head_dim + qk_rope_head_dim must be positive")
        need(self.q_lora_rank is None or self.q_lora_rank > 0, "q_lora_rank", "must be positive or null")
        need(self.mla_use_nope, "mla_use_nope", "K3's MLA is NoPE (its rope dims are never rotated); false is not "
             "modelled")
        if self.num_experts > 0:
            need(1 <= self.num_experts_per_token <= self.num_experts, "num_experts_per_token",
                 f"top-k {self.num_experts_per_token} must be in [1, num_experts={self.num_experts}]")
            need(self.moe_intermediate_size > 0, "moe_intermediate_size", "must be positive")
            need(self.num_shared_experts >= 0, "num_shared_experts", "must be >= 0")
            need(self.routed_expert_hidden_size is None or self.routed_expert_hidden_size > 0,
                 "routed_expert_hidden_size", "must be positive or null")
            need(self.moe_router_activation_func == "sigmoid", "moe_router_activation_func",
                 "K3 uses a sigmoid router")
            need(self.topk_method == "noaux_tc", "topk_method", "K3 uses noaux_tc")
            need(self.num_expert_group >= 1 and self.num_experts % self.num_expert_group == 0, "num_expert_group",
                 "must divide num_experts")
            need(1 <= self.topk_group <= self.num_expert_group, "topk_group", "must be in [1, num_expert_group]")
        need(0 <= self.first_k_dense_replace <= n, "first_k_dense_replace", f"must be in [0, {n}]")
        need(self.moe_layer_freq >= 1, "moe_layer_freq", "must be >= 1")
        need(self.hidden_act == "situ", "hidden_act", f"K3 uses 'situ', got {self.hidden_act!r}")
        need(self.activation_situ_beta > 0 and self.activation_situ_linear_beta > 0, "activation_situ_beta",
             "SiTU betas must be positive")
        need(self.attn_res_block_size is None or self.attn_res_block_size >= 1, "attn_res_block_size",
             "must be >= 1 or null")
        need(self.rms_norm_eps > 0, "rms_norm_eps", "must be positive")

    # ------------------------------------------------------------------ io
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "K3Config":
        """Accept a published `kimi_k3` config (uses its `text_config`) or a bare `kimi_linear` one.

        Strict, because this reads configs people write: `REQUIRED_FIELDS` (MoE ones only when `num_experts` > 0)
        and `REQUIRED_LINEAR_ATTN_KEYS` must be present, unknown keys other than `HF_METADATA_KEYS` are rejected
        by name, and types are checked (in `validate`). The `kimi_k3` wrapper's own keys (vision_config, ...) are
        not ours to check."""
        if not isinstance(d, dict):
            raise ConfigError(f"config: expected a dict, got {type(d).__name__}")
        if d.get("model_type") == "kimi_k3":
            if "text_config" not in d:
                raise ConfigError("text_config: a kimi_k3 config needs a text_config")
            d = d["text_config"]
            if not isinstance(d, dict):
                raise ConfigError(f"text_config: expected a dict, got {type(d).__name__}")
        mt = d.get("model_type", "kimi_linear")
        if mt != "kimi_linear":
            raise ConfigError(f"model_type: expected 'kimi_k3' or 'kimi_linear', got {mt!r}")
        d = dict(d)
        for alias, name in FIELD_ALIASES.items():
            if alias in d:
                value = d.pop(alias)
                if name in d and d[name] != value:
                    raise ConfigError(f"{alias}: {value!r} conflicts with {name}={d[name]!r} (the same field)")
                d.setdefault(name, value)
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in d if k not in names and k not in HF_METADATA_KEYS]
        if unknown:
            raise ConfigError(f"{unknown[0]}: {_unknown(unknown[0], names)}"
                              + (f" (also unknown: {', '.join(unknown[1:])})" if unknown[1:] else ""))
        if d.get("num_nextn_predict_layers") not in (None, 0):
            raise ConfigError(f"num_nextn_predict_layers: multi-token-prediction layers are not modelled; expected 0, "
                              f"got {d['num_nextn_predict_layers']!r}")
        kw = {k: d[k] for k in names if k in d}
        if "num_experts" in kw and kw["num_experts"] is None:  # a dense kimi_linear config
            kw["num_experts"] = 0
        dense = kw.get("num_experts") == 0
        if dense:  # HF writes null for the MoE sizes of a dense config; they mean nothing without experts
            kw = {k: v for k, v in kw.items() if not (k in MOE_ONLY_FIELDS and v is None)}
        required = [k for k in REQUIRED_FIELDS if not (dense and k in MOE_ONLY_FIELDS)]
        missing = [k for k in required if k not in kw]
        if "linear_attn_config" in kw:  # K3Config() reads null as "K3's layout", which a written config must not mean
            lac = kw["linear_attn_config"]
            _check_type("linear_attn_config", lac, (dict,))
            missing += [f"linear_attn_config.{k}" for k in REQUIRED_LINEAR_ATTN_KEYS if k not in lac]
        if missing:
            raise ConfigError(f"{', '.join(missing)}: required but missing (a config must state every field that "
                              f"fixes a tensor shape or a layer's kind; see k3.config.REQUIRED_FIELDS)")
        if isinstance(kw.get("eos_token_id"), list) and kw["eos_token_id"]:
            kw["eos_token_id"] = kw["eos_token_id"][0]
        return cls(**kw)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "K3Config":
        """A checkpoint directory holding config.json, or the path of a config JSON file. Every failure is a
        ConfigError naming the file (and the field, for a config that parses)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.exists():
            raise ConfigError(f"config: {p} does not exist")
        if not p.is_file():
            raise ConfigError(f"config: {p} is not a file")
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ConfigError(f"config: {p} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from e
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"config: cannot read {p}: {e}") from e
        try:
            return cls.from_dict(data)
        except ConfigError as e:
            raise ConfigError(f"{e} (in {p})") from e

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["model_type"] = "kimi_linear"
        return d

    def save_pretrained(self, path: str | Path) -> None:
        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        (p / "config.json").write_text(json.dumps(self.to_dict(), indent=2))

    def replace(self, **changes: Any) -> "K3Config":
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str) -> "K3Config":
        if name not in PRESETS:
            raise ConfigError(f"preset: unknown {name!r}; choose from {sorted(PRESETS)}")
        return cls.from_dict(PRESETS[name]())


_FIELD_TYPES = typing.get_type_hints(K3Config)


def _allowed_types(hint: Any) -> tuple[type, ...]:
    """`int | None` -> (int, NoneType); `int` -> (int,)."""
    args = typing.get_args(hint)
    return tuple(a for a in args if isinstance(a, type)) if args else (hint,)


def _type_ok(value: Any, allowed: tuple[type, ...]) -> bool:
    """JSON's types, strictly: a bool is not an int, a str is not a number, an int is a fine float, None only where
    the annotation says so."""
    if isinstance(value, bool):
        return bool in allowed
    if isinstance(value, int) and float in allowed:
        return True
    return isinstance(value, allowed)


def _type_message(name: str, value: Any, allowed: tuple[type, ...]) -> str:
    names = {type(None): "null", list: "list", tuple: "list", dict: "dict"}
    want = " or ".join(dict.fromkeys(names.get(t, t.__name__) for t in allowed))
    return f"{name}: expected {want}, got {names.get(type(value), type(value).__name__)} ({value!r})"


def _check_type(name: str, value: Any, allowed: tuple[type, ...]) -> None:
    if not _type_ok(value, allowed):
        raise ConfigError(_type_message(name, value, allowed))


def _unknown(key: str, known: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1)
    return "unknown field" + (f" (did you mean {close[0]!r}?)" if close else "")


def _default_linear_attn(n_layers: int) -> dict:
    """K3's layout for n layers: every 4th layer MLA and the last layer MLA; the rest KDA."""
    full = sorted({i for i in range(4, n_layers + 1, 4)} | {n_layers})
    kda = [i for i in range(1, n_layers + 1) if i not in full]
    return {"kda_layers": kda, "full_attn_layers": full, "num_heads": 96, "head_dim": 128,
            "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "use_full_rank_gate": True}


def _k3_dict() -> dict:
    """The published Kimi K3 config (text part; see shared/reference/k3-architecture.md §1.1): the field
    defaults of K3Config are the published values."""
    return {"model_type": "kimi_k3", "text_config": K3Config().to_dict()}


def _scaled_dict(*, hidden: int, layers: int, vocab: int, kda_heads: int, head_dim: int, mla_heads: int,
                 q_lora: int, kv_lora: int, nope: int, rope: int, v_dim: int, experts: int, topk: int,
                 moe_inter: int, dense_inter: int, block: int) -> dict:
    lac = _default_linear_attn(layers) | {"num_heads": kda_heads, "head_dim": head_dim}
    return {"model_type": "kimi_linear", "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": dense_inter, "linear_attn_config": lac, "num_attention_heads": mla_heads,
            "q_lora_rank": q_lora, "kv_lora_rank": kv_lora, "qk_nope_head_dim": nope, "qk_rope_head_dim": rope,
            "v_head_dim": v_dim, "num_experts": experts, "num_experts_per_token": topk, "num_shared_experts": 2,
            "moe_intermediate_size": moe_inter, "routed_expert_hidden_size": hidden // 2,
            "latent_moe_use_norm": True, "first_k_dense_replace": 1, "moe_layer_freq": 1,
            "tie_word_embeddings": False, "mla_use_output_gate": True,
            "attn_res_block_size": block, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


PRESETS = {
    "k3": _k3_dict,
    # 8 layers: KDA 1-3, 5-7; MLA 4, 8 -> 3:1, last layer MLA; blocks of 2 layers -> 4 stored rows + partial.
    "small": lambda: _scaled_dict(hidden=1024, layers=8, vocab=32768, kda_heads=8, head_dim=128, mla_heads=8,
                                  q_lora=384, kv_lora=256, nope=64, rope=32, v_dim=64, experts=32, topk=4,
                                  moe_inter=384, dense_inter=2816, block=2),
    "tiny": lambda: _scaled_dict(hidden=128, layers=8, vocab=512, kda_heads=2, head_dim=32, mla_heads=2,
                                 q_lora=64, kv_lora=32, nope=16, rope=8, v_dim=16, experts=8, topk=2,
                                 moe_inter=64, dense_inter=256, block=2),
}
