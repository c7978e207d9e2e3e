"""The main job's configuration: a TOML file of sections, every field typed and checked. An unknown section or
field, a wrong type or an out-of-range value is a `JobConfigError` naming `section.field`.

Everything a run would trip over later is checked here, before any work: a bad value found after the SFT base
has trained (minutes) is minutes lost. Besides each field's own range (the `_RULES` table, one rule per field;
NaN and infinity are refused in every float field generically) that covers the engine the job builds: its
`EngineConfig` comes from `engine_config(cfg)`, the one place RLJob takes it from too, and its pools must hold one
request of the largest group at the longest episode the calculator task can produce."""
from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from k3.config import PRESETS
from k3.envs.calc_task import HELDOUT_SIZE, MAX_TURNS, CalculatorEnv
from k3.envs.calculator import MAX_CHARS, MAX_MAGNITUDE

if TYPE_CHECKING:  # k3.rollout imports torch and the model: loaded only when an engine config is built
    from k3.rollout import EngineConfig


class JobConfigError(ValueError):
    """A bad job configuration; the message starts with the field it is about (`section.field: why`)."""


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
    checkpoint_every: int = 64   # KDA state checkpoint interval in tokens (a multiple of the engine's chunk, 64)
    state_slots: int = 512       # KDA state slots (device tier; as many again on the host tier)
    kv_pages: int = 8192         # MLA latent pages of 16 tokens (device tier; as many again on the host tier)
    speculative: str = "off"     # speculative decoding: "off" or "METHOD[:DRAFT[:VERIFY[:ACCEPTANCE]]]", "ngram:3", "ngram:2x3"
    backend: str = "embedded"    # who rolls out: "embedded" (k3.rollout.Engine) or "vllm" (k3_vllm, pip install .[vllm])
    cuda_graphs: bool = True     # the embedded engine's decode steps as CUDA graphs on a GPU (k3.rollout.graphs)


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
    micro_batch_size: int = 16   # sequences per learner forward/backward (the update's gradient is accumulated;
    #                              more than the update's tasks_per_update * group_size sequences = one pass)
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
        """Raise JobConfigError (`section.field: why`) unless every field is of its type, finite, in its range,
        and the engine and its pools accept the rollout settings."""
        for name, want, value in _leaves(self):
            _check_type(name, want, value)
            if want is float and not math.isfinite(value):
                raise JobConfigError(f"{name}: must be finite, got {value}")
            if name not in _RULES:  # tests/jobs/test_job_config.py::test_every_field_has_a_rule
                raise LookupError(f"{name}: no rule in k3.jobs.config._RULES (every field needs one)")
            ok, why = _RULES[name]
            if not ok(value):
                raise JobConfigError(f"{name}: {why}, got {value!r}")
        _check_pools(self, engine_config(self))


# ---------------------------------------------------------------------------------------------- field rules
SEED_LIMIT = 2 ** 63  # torch.manual_seed takes 64-bit seeds; TOML integers are signed 64-bit
Rule = tuple[Callable[[Any], bool], str]


def _at_least(n: int) -> Rule:
    return (lambda v: v >= n), f"must be >= {n}"


def _positive(why: str = "") -> Rule:
    return (lambda v: v > 0), "must be > 0" + why


def _probability() -> Rule:
    return (lambda v: 0.0 <= v <= 1.0), "must be a probability in [0, 1]"


def _seed() -> Rule:
    return (lambda v: 0 <= v < SEED_LIMIT), "must be in [0, 2**63)"


_ANY: Rule = ((lambda v: True), "")  # a bool field: its type check is all there is

# One rule per field, keyed `section.field` (a test checks that every field has one, so a new field cannot be
# left unchecked). Types and, for floats, finiteness are checked for every field before its rule.
_RULES: dict[str, Rule] = {
    "updates": _at_least(1),
    "model.preset": ((lambda v: v in PRESETS), f"must be one of {sorted(PRESETS)}"),
    "model.seed": _seed(),
    "sft.cache_dir": ((lambda v: v.strip() != ""), "must be a directory path, not empty"),
    "sft.steps": _at_least(1),
    "sft.batch_size": _at_least(1),
    "sft.lr": _positive(),
    "sft.p_tool": _probability(),
    "sft.p_slip": _probability(),
    "sft.p_copy": _probability(),
    "sft.seed": _seed(),
    "rollout.tasks_per_update": _at_least(1),
    "rollout.group_size": ((lambda v: v >= 2), "must be >= 2: GSPO's advantages are relative to the group"),
    "rollout.max_turn_tokens": _at_least(1),
    "rollout.temperature": _positive(" (0 would be greedy: a group's samples identical, every advantage 0)"),
    "rollout.top_p": ((lambda v: 0.0 < v <= 1.0), "must be in (0, 1] (1 = off)"),
    "rollout.top_k": ((lambda v: v >= 0), "must be >= 0 (0 = off)"),
    "rollout.prefix_cache": _ANY,
    "rollout.cuda_graphs": _ANY,                # a bool: the engine's check (engine_config())
    "rollout.checkpoint_every": _at_least(1),  # and what the engine requires: engine_config()
    "rollout.state_slots": _at_least(1),       # and room for one request: _check_pools()
    "rollout.kv_pages": _at_least(1),
    "rollout.backend": ((lambda v: v in _rollout_backends()), "must be a rollout backend of k3.rollout.backend.BACKENDS "
                        "('embedded', 'vllm')"),
    "rollout.speculative": ((lambda v: _speculative_ok(v)), "must be 'off' or 'METHOD[:DRAFT[:VERIFY[:ACCEPTANCE]]]'"
                            " with METHOD ngram or drafter, DRAFT a chain length in [1, 15] or a tree BRANCHxDEPTH"
                            " (at most 15 nodes), VERIFY exact or batched, ACCEPTANCE rejection or match"
                            " (k3.rollout.spec)"),
    "rl.mode": ((lambda v: v in ("lora", "full")), "must be 'lora' or 'full'"),
    "rl.lr": _positive(),
    "rl.lora_rank": _at_least(1),
    "rl.lora_alpha": _positive(" (the adapter's output is scaled by lora_alpha / lora_rank)"),
    "rl.eps_low": ((lambda v: 0.0 < v < 1.0), "must be in (0, 1) (the GSPO clip range is [1 - eps_low, 1 + eps_high])"),
    "rl.eps_high": _positive(" (the GSPO clip range is [1 - eps_low, 1 + eps_high])"),
    "rl.router_replay": _ANY,
    "rl.kl_coef": ((lambda v: v >= 0), "must be >= 0 (0 = no KL penalty)"),
    # the learner clips the gradient to this norm; its "off" is None, which a TOML float cannot carry
    "rl.max_grad_norm": _positive(" (the learner clips the gradient norm to it)"),
    "rl.micro_batch_size": _at_least(1),
    "rl.train_seed": _seed(),
    "sync.full_every": _at_least(1),
    "sync.zstd_level": ((lambda v: 1 <= v <= 22), "must be in [1, 22] (zstd's compression levels)"),
    "eval.every": _at_least(1),
    "eval.heldout": ((lambda v: 1 <= v <= HELDOUT_SIZE), f"must be in [1, {HELDOUT_SIZE}] (the held-out set has "
                     f"{HELDOUT_SIZE} tasks)"),
    "eval.samples": _at_least(1),
}


def _speculative_ok(text: str) -> bool:
    from k3.rollout.spec import SpecConfig
    try:
        SpecConfig.parse(text)
    except ValueError:
        return False
    return True


def _field_type(f: dataclasses.Field) -> type:
    """A field's type, read off its default (the annotations are strings under `from __future__ import annotations`)."""
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return type(default)


def _leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, type, Any]]:
    """(`section.field`, type, value) of every scalar field of a JobConfig, sections walked in order."""
    for f in dataclasses.fields(obj):
        value, want = getattr(obj, f.name), _field_type(f)
        if dataclasses.is_dataclass(want):
            if not isinstance(value, want):
                raise JobConfigError(f"{prefix}{f.name}: expected a [{f.name}] section, got {type(value).__name__}")
            yield from _leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", want, value


def _type_ok(want: type, value: Any) -> bool:
    """Exact types (a bool is not an int); an int is accepted for a float field."""
    return type(value) is want or (want is float and type(value) is int)


def _rollout_backends() -> tuple[str, ...]:
    from k3.rollout.backend import BACKENDS

    return tuple(BACKENDS)


def _check_type(name: str, want: type, value: Any) -> None:
    if not _type_ok(want, value):
        raise JobConfigError(f"{name}: expected {want.__name__}, got {type(value).__name__} ({value!r})")


# ---------------------------------------------------------------------------------------------- the engine
# EngineConfig field -> the job field it is built from (RLJob's engine: state and page pools as large again on
# the host tier as on the device). One table, so an engine error names the job field the user can change.
ENGINE_FIELDS = {"checkpoint_interval": "rollout.checkpoint_every",
                 "device_states": "rollout.state_slots", "host_states": "rollout.state_slots",
                 "device_pages": "rollout.kv_pages", "host_pages": "rollout.kv_pages",
                 "cuda_graphs": "rollout.cuda_graphs"}


def _get(cfg: JobConfig, dotted: str) -> Any:
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def engine_config(cfg: JobConfig) -> "EngineConfig":
    """The rollout engine's configuration for this job, validated: what RLJob builds its Engine from. The engine's
    ValueError (`<engine field>: why`) becomes a JobConfigError naming the job field (`ENGINE_FIELDS`)."""
    from k3.rollout import EngineConfig

    from k3.rollout.spec import SpecConfig
    try:   # "off" or "ngram:3"-style (the field's rule has checked it in validate())
        speculative = SpecConfig.parse(cfg.rollout.speculative)
    except ValueError as e:
        raise JobConfigError(f"rollout.speculative: {e}") from e
    if speculative is not None and speculative.method.value == "drafter" and speculative.drafter_path is None:
        from k3.rollout.spec.train_drafter import default_drafter_dir
        path = default_drafter_dir(cfg)
        if not path.exists():
            raise JobConfigError(f"rollout.speculative: no trained drafter for this SFT base at {path}; run "
                                 f"`k3 train-drafter` (same --config/--set) first")
        speculative = dataclasses.replace(speculative, drafter_path=str(path))
    ec = EngineConfig(**{k: _get(cfg, v) for k, v in ENGINE_FIELDS.items()}, speculative=speculative)
    try:
        ec.validate()
    except ValueError as e:
        engine_field, _, why = str(e).partition(":")
        job_field = ENGINE_FIELDS.get(engine_field.strip())
        if job_field is None:  # an engine default the job does not set: the engine's own settings are wrong
            raise JobConfigError(f"rollout: the engine refuses its defaults: {e}") from e
        raise JobConfigError(f"{job_field}: {why.strip()} [engine {engine_field.strip()}]") from e
    return ec


def max_episode_tokens(max_turn_tokens: int) -> int:
    """An upper bound on the tokens of one calculator episode, hence on any request's prompt + max_tokens.

    An episode (k3.envs.calc_task.CalculatorEnv) is the prompt, then at most MAX_TURNS model turns of at most
    `max_turn_tokens` each, with a tool result between two turns (none after the last). Bounds, from the task's
    constants: the prompt is the system prompt, "Q:", the expression and "="; a task's expression passed
    `evaluate`, so it has at most MAX_CHARS characters, one token each. A result is "<result> v </result>" where v
    is "error" (one token) or an integer of magnitude <= MAX_MAGNITUDE, one token per character."""
    env = CalculatorEnv()
    prompt = len(env.system) + len(env.tok.encode("Q: =")) + MAX_CHARS
    result = len(env.tok.encode("<result> </result>")) + len(str(-MAX_MAGNITUDE))
    return prompt + MAX_TURNS * max_turn_tokens + (MAX_TURNS - 1) * result


def _check_pools(cfg: JobConfig, ec: "EngineConfig") -> None:
    """The device pools must hold one request of the largest group (rollout: group_size samples, evaluation:
    eval.samples) at the longest episode; the engine would refuse it mid-run (Engine._check_fits: n samples need
    n * (ceil(tokens / page_size) + 1) pages plus one spare, and n + 1 state slots)."""
    n = max(cfg.rollout.group_size, cfg.eval.samples)
    who = "rollout.group_size" if n == cfg.rollout.group_size else "eval.samples"
    tokens = max_episode_tokens(cfg.rollout.max_turn_tokens)
    pages = n * (math.ceil(tokens / ec.page_size) + 1) + 1
    if cfg.rollout.kv_pages < pages:
        raise JobConfigError(f"rollout.kv_pages: must be >= {pages} to hold one request of {n} samples "
                             f"({who}) of up to {tokens} tokens (pages of {ec.page_size}), got {cfg.rollout.kv_pages}")
    if cfg.rollout.state_slots < n + 1:
        raise JobConfigError(f"rollout.state_slots: must be >= {n + 1} to hold one request of {n} samples ({who}) "
                             f"and a spare, got {cfg.rollout.state_slots}")


# ---------------------------------------------------------------------------------------------- loading
def _build(cls, data: dict[str, Any], prefix: str):
    fields_ = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if key not in fields_:
            raise JobConfigError(f"{name}: unknown field (known: {', '.join(sorted(fields_))})")
        want = _field_type(fields_[key])
        if dataclasses.is_dataclass(want):
            if not isinstance(value, dict):
                raise JobConfigError(f"{name}: expected a [{key}] table, got {type(value).__name__} ({value!r})")
            kwargs[key] = _build(want, value, f"{name}.")
            continue
        if want is float and type(value) is int:
            value = float(value)
        _check_type(name, want, value)
        kwargs[key] = value
    return cls(**kwargs)


def _set(data: dict[str, Any], key: str, value: Any) -> None:
    """Put override `key` ("section.field" or a top-level "field") into the TOML data, walking the schema so that
    a sub-field of a scalar ("rl.lr.x") or of an unknown section is a JobConfigError, not a TypeError."""
    parts = key.split(".")
    if not key or "" in parts:
        raise JobConfigError(f"{key or '(empty)'}: not a field name (expected SECTION.FIELD or FIELD)")
    cls, d = JobConfig, data
    for i, part in enumerate(parts[:-1]):
        name = ".".join(parts[: i + 1])
        fields_ = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields_:
            raise JobConfigError(f"{name}: unknown field (known: {', '.join(sorted(fields_))})")
        want = _field_type(fields_[part])
        if not dataclasses.is_dataclass(want):
            raise JobConfigError(f"{key}: {name} is a single {want.__name__} value, it has no sub-fields")
        sub = d.setdefault(part, {})
        if not isinstance(sub, dict):
            raise JobConfigError(f"{name}: expected a [{part}] table, got {type(sub).__name__} ({sub!r})")
        cls, d = want, sub
    d[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> JobConfig:
    """Defaults, then the TOML file (if any), then `overrides` ({"updates": 3, "rl.lr": 1e-3}); validated."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise JobConfigError(f"config: {p} {'is not a file' if p.exists() else 'does not exist'}")
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise JobConfigError(f"config: {p} is not valid TOML: {e}") from e
        except OSError as e:
            raise JobConfigError(f"config: cannot read {p}: {e.strerror or e}") from e
    for key, value in (overrides or {}).items():
        _set(data, key, value)
    cfg = _build(JobConfig, data, "")
    cfg.validate()
    return cfg
