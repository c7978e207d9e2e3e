"""Checkpoint adapter (TorchTitan `state_dict_adapter` style): our stacked-expert state dict <-> the kimi_linear /
kimi_k3 checkpoint layout (`...block_sparse_moe.experts.{e}.w{1,2,3}.weight`), safetensors I/O, strict loading.

`from_hf` also accepts the multimodal K3 layout (`language_model.` prefix, vision weights ignored), `mlp` for
`block_sparse_moe`, and the checkpoint quirk of `A_log` stored as a longer 1-D (or [1, 1, H, 1]) tensor.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from k3.config import K3Config

_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123])\.weight$")
_STACKED = re.compile(r"^(.*\.experts)\.(w[123])$")
WEIGHTS_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint does not match the model; the message names the offending tensors."""


def to_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Split stacked experts into per-expert tensors named as in the published checkpoint."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        m = _STACKED.match(name)
        if m:
            for e in range(t.shape[0]):
                out[f"{m.group(1)}.{e}.{m.group(2)}.weight"] = t[e].contiguous()
        else:
            out[name] = t.contiguous()
    return out


def _normalise_name(name: str) -> str | None:
    if name.startswith(("vision_tower.", "mm_projector.")):
        return None
    if name.startswith("language_model."):
        name = name[len("language_model."):]
        if name.startswith("layers."):
            name = "model." + name
    return name.replace(".mlp.experts.", ".block_sparse_moe.experts.").replace(
        ".mlp.gate.", ".block_sparse_moe.gate.").replace(".mlp.shared_experts.", ".block_sparse_moe.shared_experts.").replace(
        ".mlp.routed_expert_", ".block_sparse_moe.routed_expert_")


def from_hf(hf: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map checkpoint tensors onto our names and shapes; raise CheckpointError naming missing, unexpected or
    mis-shaped tensors. `expected` is the model's own state dict (for names and shapes)."""
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    mapped: dict[str, torch.Tensor] = {}
    for raw, t in hf.items():
        name = _normalise_name(raw)
        if name is None:
            continue
        m = _EXPERT.match(name)
        if m:
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = t
            continue
        if name.endswith(".A_log") and name in expected:
            n = expected[name].numel()
            if t.dim() == 4 or (t.dim() == 1 and t.numel() > n):
                t = t.reshape(-1)[:n]
        mapped[name] = t
    problems: list[str] = []
    for (prefix, w), per in experts.items():
        name = f"{prefix}.{w}"
        if name not in expected:
            problems.append(f"unexpected: {prefix}.*.{w}.weight")
            continue
        n_exp = expected[name].shape[0]
        missing = sorted(set(range(n_exp)) - set(per))
        extra = sorted(set(per) - set(range(n_exp)))
        if missing:
            problems.append(f"missing: {prefix}.{{{_ranges(missing)}}}.{w}.weight")
        if extra:
            problems.append(f"unexpected: {prefix}.{{{_ranges(extra)}}}.{w}.weight")
        if not missing and not extra:
            shapes = {tuple(x.shape) for x in per.values()}
            if shapes != {tuple(expected[name].shape[1:])}:
                problems.append(f"shape mismatch: {prefix}.*.{w}.weight: checkpoint {sorted(shapes)}, "
                                f"model {tuple(expected[name].shape[1:])}")
            else:
                mapped[name] = torch.stack([per[e] for e in range(n_exp)])
    for name in sorted(set(expected) - set(mapped)):
        if not any(p.startswith(f"missing: {name.rsplit('.', 1)[0]}") for p in problems):
            problems.append(f"missing: {name}")
    for name in sorted(set(mapped) - set(expected)):
        problems.append(f"unexpected: {name}")
    for name in sorted(set(mapped) & set(expected)):
        if tuple(mapped[name].shape) != tuple(expected[name].shape):
            problems.append(f"shape mismatch: {name}: checkpoint {tuple(mapped[name].shape)}, "
                            f"model {tuple(expected[name].shape)}")
    if problems:
        raise CheckpointError("checkpoint does not match the model:\n  " + "\n  ".join(problems))
    return mapped


def _ranges(ids: list[int]) -> str:
    return ",".join(map(str, ids[:8])) + (",..." if len(ids) > 8 else "")


def save_pretrained(model, path: str | Path) -> None:
    """config.json + model.safetensors in the checkpoint's names (bit-exact round trip)."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(p)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tmp = p / (WEIGHTS_FILE + ".tmp")
    save_file(to_hf(state), str(tmp), metadata={"format": "pt"})
    tmp.replace(p / WEIGHTS_FILE)


def load_pretrained(path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"):
    """Build the model from config.json and load every *.safetensors file strictly."""
    from k3.model.model import K3ForCausalLM

    p = Path(path)
    cfg = K3Config.from_pretrained(p)
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"checkpoint: no *.safetensors files in {p}")
    hf: dict[str, torch.Tensor] = {}
    for f in files:
        hf.update(load_file(str(f)))
    with torch.device("meta"):
        model = K3ForCausalLM(cfg, init=False)
    expected = model.state_dict()
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    state = from_hf(hf, expected)
    model = model.to_empty(device=device)
    model.load_state_dict(state, strict=not cfg.tie_word_embeddings, assign=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if dtype is not None:
        model = model.to(dtype)
    return model
