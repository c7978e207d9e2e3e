"""LoRA adapter weights (Hu et al., arXiv 2106.09685) for K3 and their adapter-only safetensors format.

For a target with base weight W [out, in] the adapted weight is W + (alpha / r) * B @ A with A [r, in], B [out, r];
stacked routed experts ([E, out, in]) get one pair per expert, A [E, r, in], B [E, out, r]. A starts uniform in
+-1/sqrt(in) (PEFT's kaiming-uniform bound) and B at zero, so a new adapter leaves the model unchanged.

An adapter holds only its own tensors; `k3.lora.LoRAManager` applies it to a model (hooks, no base copy).
File: one safetensors file with `<target>.lora_A` / `<target>.lora_B` tensors and metadata
`{"format": "k3-lora", "version": "1", "config": <LoRAConfig json>}`.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from k3.lora.config import LoRAConfig, Target, candidate_targets, resolve_targets

FORMAT = "k3-lora"
VERSION = "1"


class LoRAError(ValueError):
    """An adapter does not fit a model (or a file is not a K3 adapter); the message names the tensor."""


def _key(name: str) -> str:
    return name.replace(".", "/")  # parameter names may not contain dots


class LoRAAdapter(nn.Module):
    """The A/B matrices of one adapter for a fixed set of targets (see `k3.lora.config.Target`)."""

    def __init__(self, config: LoRAConfig, targets: dict[str, Target], *, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32, seed: int | None = None) -> None:
        super().__init__()
        if not targets:
            raise LoRAError("an adapter needs at least one target")
        self.config = config
        self.targets = dict(targets)
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        r = config.rank
        # initialised on the CPU (same values for a seed on any device); on the meta device only shapes exist
        init_device = "meta" if torch.device(device or "cpu").type == "meta" else "cpu"
        for name, t in self.targets.items():
            a = torch.empty(t.a_shape(r), device=init_device)
            b = torch.zeros(t.b_shape(r), device=init_device)
            if init_device == "cpu":
                bound = 1.0 / math.sqrt(t.in_features)
                a.uniform_(-bound, bound, generator=gen)
                if config.init_scale > 0:
                    b.normal_(0.0, config.init_scale, generator=gen)
            self.lora_A[_key(name)] = nn.Parameter(a.to(device=device, dtype=dtype))
            self.lora_B[_key(name)] = nn.Parameter(b.to(device=device, dtype=dtype))

    @classmethod
    def for_model(cls, model: nn.Module, config: LoRAConfig, *, dtype: torch.dtype = torch.float32,
                  seed: int | None = None) -> "LoRAAdapter":
        """A new adapter for the targets of `model` selected by `config.targets`, on the model's device."""
        device = next(model.parameters()).device
        return cls(config, resolve_targets(model, config.targets), device=device, dtype=dtype, seed=seed)

    @property
    def scaling(self) -> float:
        return self.config.scaling

    def A(self, name: str) -> torch.Tensor:
        return self.lora_A[_key(name)]

    def B(self, name: str) -> torch.Tensor:
        return self.lora_B[_key(name)]

    def delta(self, name: str) -> torch.Tensor:
        """(alpha / r) * B @ A for target `name`: [out, in], or [E, out, in] for experts (fp32 or the adapter's
        dtype). Computed the same way every time, so merging and `merged_state_dict` agree bit for bit."""
        return (self.B(name) @ self.A(name)) * self.scaling

    def tensors(self) -> dict[str, torch.Tensor]:
        """The adapter's tensors under their file names (`<target>.lora_A|B`), detached."""
        out: dict[str, torch.Tensor] = {}
        for name in self.targets:
            out[f"{name}.lora_A"] = self.A(name).detach()
            out[f"{name}.lora_B"] = self.B(name).detach()
        return out

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ------------------------------------------------------------------ io
    def save(self, path: str | Path) -> None:
        """Write the adapter alone (no base weights) to a safetensors file with its config as metadata."""
        tensors = {k: v.contiguous().cpu() for k, v in self.tensors().items()}
        meta = {"format": FORMAT, "version": VERSION, "config": json.dumps(self.config.to_dict())}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path, model: nn.Module, *, dtype: torch.dtype | None = None) -> "LoRAAdapter":
        """Read an adapter file written by `save` for `model` (placed on the model's device).

        Raises LoRAError when the file is not a K3 adapter, or its tensors do not fit the model: unknown targets,
        missing A/B halves, ranks or shapes that differ from the model's projections."""
        p = Path(path)
        if not p.is_file():
            raise LoRAError(f"adapter file {p} does not exist")
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise LoRAError(f"{p} is not a K3 LoRA adapter (metadata 'format' is {meta.get('format')!r}, "
                                f"expected {FORMAT!r})")
            if meta.get("version") != VERSION:
                raise LoRAError(f"{p}: unsupported adapter version {meta.get('version')!r} (expected {VERSION!r})")
            try:
                config = LoRAConfig.from_dict(json.loads(meta["config"]))
            except (KeyError, TypeError, ValueError) as e:
                raise LoRAError(f"{p}: bad adapter config in metadata: {e}") from None
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        targets = _check_tensors(tensors, config, model, str(p))
        device = next(model.parameters()).device
        first = next(iter(tensors.values()))
        ad = cls(config, targets, device=device, dtype=dtype or first.dtype)
        with torch.no_grad():
            for name in targets:
                ad.A(name).copy_(tensors[f"{name}.lora_A"])
                ad.B(name).copy_(tensors[f"{name}.lora_B"])
        return ad

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy `<target>.lora_A|B` tensors (e.g. another adapter's `tensors()`) into this adapter, all or nothing."""
        own = self.tensors()   # once: building it walks every target
        want, got = set(own), set(tensors)
        if want != got:
            missing, extra = sorted(want - got), sorted(got - want)
            raise LoRAError(f"adapter tensors do not match: missing {missing[:4]}, unexpected {extra[:4]}")
        for k, v in tensors.items():
            mine = own[k]
            if tuple(v.shape) != tuple(mine.shape):
                raise LoRAError(f"adapter tensor {k!r} has shape {tuple(v.shape)}, expected {tuple(mine.shape)}")
        with torch.no_grad():
            for name in self.targets:
                self.A(name).copy_(tensors[f"{name}.lora_A"])
                self.B(name).copy_(tensors[f"{name}.lora_B"])


def _check_tensors(tensors: dict[str, torch.Tensor], config: LoRAConfig, model: nn.Module, src: str
                   ) -> dict[str, Target]:
    """Validate adapter tensors against `model`; return the targets in model order."""
    cands = candidate_targets(model)
    names: set[str] = set()
    for k in tensors:
        base, _, half = k.rpartition(".")
        if half not in ("lora_A", "lora_B") or not base:
            raise LoRAError(f"{src}: tensor {k!r} is not named '<target>.lora_A' or '<target>.lora_B'")
        if base not in cands:
            raise LoRAError(f"{src}: tensor {k!r} targets {base!r}, which this model does not have")
        names.add(base)
    if not names:
        raise LoRAError(f"{src}: the adapter holds no tensors")
    r = config.rank
    for name in sorted(names):
        t = cands[name]
        for half, want in (("lora_A", t.a_shape(r)), ("lora_B", t.b_shape(r))):
            k = f"{name}.{half}"
            if k not in tensors:
                raise LoRAError(f"{src}: tensor {k!r} is missing (its other half is present)")
            if tuple(tensors[k].shape) != want:
                raise LoRAError(f"{src}: tensor {k!r} has shape {tuple(tensors[k].shape)} but this model's "
                                f"{t.weight_name} at rank {r} needs {want}")
            if not tensors[k].is_floating_point():
                raise LoRAError(f"{src}: tensor {k!r} has dtype {tensors[k].dtype}, expected a floating dtype")
    try:
        expected = set(resolve_targets(model, config.targets))
    except ValueError as e:
        raise LoRAError(f"{src}: the adapter's target patterns do not fit this model: {e}") from None
    if expected != names:
        missing, extra = sorted(expected - names), sorted(names - expected)
        raise LoRAError(f"{src}: the adapter's patterns {list(config.targets)} select {len(expected)} targets on this "
                        f"model but the file holds {len(names)} (missing {missing[:3]}, not selected {extra[:3]})")
    return {n: t for n, t in cands.items() if n in names}
