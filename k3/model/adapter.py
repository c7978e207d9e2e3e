"""Checkpoint adapter (TorchTitan `state_dict_adapter` style): our stacked-expert state dict <-> the kimi_linear /
kimi_k3 checkpoint layout (`...block_sparse_moe.experts.{e}.w{1,2,3}.weight`), safetensors I/O, strict loading.

`from_hf` also accepts the multimodal K3 layout (`language_model.` prefix, vision weights ignored), `mlp` for
`block_sparse_moe`, Kimi Linear's `A_log` layout `[1, 1, H, 1]`, and one checkpoint quirk, explicitly: the published
K3 checkpoint stores each KDA layer's `A_log` as F32[128] for its 96 heads (shared/reference/k3-architecture.md
§1.1; the first 96 values are the heads'). Any other `A_log` length is a shape mismatch, never a silent truncation.

Routed experts may be stored as the published checkpoint stores them, MXFP4 in compressed-tensors'
`mxfp4-pack-quantized` layout: `<name>.weight_packed` (uint8 [out, in / 2]) beside `<name>.weight_scale` (E8M0
[out, in / 32], uint8 or float8_e8m0fnu); `from_hf` dequantises each pair to `<name>.weight` in bf16 (exact) before
mapping, so the model, the vLLM plugin and TorchTitan's adapter all read them (shared/reference/k3-architecture.md
§5.4). A packed tensor without its scales, or scales that do not fit it, is a CheckpointError naming both.

Loading is all-or-nothing: every file is read and every tensor checked before a model exists, and each failure
(missing or unreadable config.json, a truncated or corrupt safetensors file, a tensor stored twice, a mismatch) is
a ConfigError or CheckpointError naming the file or tensor.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from k3.config import K3Config
from k3.model import ops

_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123])\.weight$")
_STACKED = re.compile(r"^(.*\.experts)\.(w[123])$")
WEIGHTS_FILE = "model.safetensors"
MXFP4_PACKED, MXFP4_SCALE = ".weight_packed", ".weight_scale"
#: The published K3 checkpoint's A_log quirk as {heads in the model: values stored}; see the module docstring.
A_LOG_STORED_LENGTHS = {96: 128}


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
    for raw, t in dequantize_mxfp4_tensors(hf).items():
        name = _normalise_name(raw)
        if name is None:
            continue
        m = _EXPERT.match(name)
        if m:
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = t
            continue
        if name.endswith(".A_log") and name in expected:
            t = _a_log_as_model(t, expected[name])
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
                            f"model {tuple(expected[name].shape)}"
                            + (_A_LOG_HINT if name.endswith(".A_log") else ""))
    if problems:
        raise CheckpointError("checkpoint does not match the model:\n  " + "\n  ".join(problems))
    return mapped


def dequantize_mxfp4_pair(base: str, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`base.weight` in bf16 from its MXFP4 pair (`base.weight_packed` uint8 [out, in / 2], `base.weight_scale` E8M0
    [out, in / 32] as uint8 or float8_e8m0fnu), exact; a pair that does not fit is a CheckpointError naming both.
    The one decoding of the format: `from_hf` and TorchTitan's MXFP4 storage reader both call it."""
    return ops.dequantize_mxfp4(packed, _checked_mxfp4_scales(base, packed, scales), torch.bfloat16)


def _checked_mxfp4_scales(base: str, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    if scales.dtype == getattr(torch, "float8_e8m0fnu", None):
        scales = scales.view(torch.uint8)   # the same E8M0 exponent bits
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointError(f"{base}{MXFP4_PACKED}, {base}{MXFP4_SCALE}: MXFP4 expects uint8 codes and E8M0 "
                              f"scales, got {packed.dtype}, {scales.dtype}")
    if packed.dim() != 2 or (2 * packed.shape[1]) % 32 or tuple(scales.shape) != (packed.shape[0],
                                                                                    2 * packed.shape[1] // 32):
        raise CheckpointError(f"{base}{MXFP4_SCALE}: shape {tuple(scales.shape)} does not fit {base}{MXFP4_PACKED} "
                              f"{tuple(packed.shape)} (expected [out, in / 32] for packed [out, in / 2], in a multiple "
                              "of 32)")
    return scales


def dequantize_mxfp4_tensors(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """hf with every MXFP4 pair (`X.weight_packed`, `X.weight_scale`) replaced by `X.weight` in bf16; every pair
    is checked before any is expanded (a CheckpointError lists each broken one)."""
    packed = {n[: -len(MXFP4_PACKED)] for n in hf if n.endswith(MXFP4_PACKED)}
    scaled = {n[: -len(MXFP4_SCALE)] for n in hf if n.endswith(MXFP4_SCALE)}
    if not packed and not scaled:
        return hf
    problems = [f"{b}{MXFP4_PACKED}: MXFP4 weight without its scales {b}{MXFP4_SCALE}" for b in sorted(packed - scaled)]
    problems += [f"{b}{MXFP4_SCALE}: MXFP4 scales without a packed weight {b}{MXFP4_PACKED}"
                 for b in sorted(scaled - packed)]
    pairs = {}
    for base in sorted(packed & scaled):
        if base + ".weight" in hf:
            problems.append(f"{base}.weight: stored both as bf16 and as MXFP4 ({base}{MXFP4_PACKED})")
            continue
        try:
            pairs[base] = (hf[base + MXFP4_PACKED], _checked_mxfp4_scales(base, hf[base + MXFP4_PACKED],
                                                                           hf[base + MXFP4_SCALE]))
        except CheckpointError as e:
            problems.append(str(e))
    if problems:
        raise CheckpointError("checkpoint's MXFP4 tensors:\n  " + "\n  ".join(problems))
    out = {n: t for n, t in hf.items() if not n.endswith((MXFP4_PACKED, MXFP4_SCALE))}
    for base, (p, s) in pairs.items():
        out[base + ".weight"] = ops.dequantize_mxfp4(p, s, torch.bfloat16)
    return out


_A_LOG_HINT = (" (A_log must hold one value per KDA head, as [H] or [1, 1, H, 1]; the only other length accepted is"
               " the published K3 checkpoint's 128 values for 96 heads)")


def _a_log_as_model(t: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """A checkpoint's A_log in the model's [H] shape when it is one of the accepted layouts ([H], Kimi Linear's
    [1, 1, H, 1], or K3's 128 values for 96 heads, flat or 4-D); otherwise unchanged, so the shape check reports
    the checkpoint's own shape."""
    if want.dim() != 1:
        return t
    flat = t.reshape(-1) if t.dim() == 4 and (t.shape[0], t.shape[1], t.shape[3]) == (1, 1, 1) else t
    h = want.shape[0]
    if flat.dim() == 1 and flat.shape[0] == h:
        return flat
    if flat.dim() == 1 and flat.shape[0] == A_LOG_STORED_LENGTHS.get(h):
        return flat[:h]
    return t


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
    stored_in: dict[str, Path] = {}
    for f in files:
        tensors = _read_safetensors(f)
        for name in tensors:
            if name in stored_in:
                raise CheckpointError(f"{name}: stored in both {stored_in[name]} and {f}")
            stored_in[name] = f
        hf.update(tensors)
    with torch.device("meta"):
        model = K3ForCausalLM(cfg, init=False)
    expected = model.state_dict()
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    try:
        state = from_hf(hf, expected)
    except CheckpointError as e:
        raise CheckpointError(f"{p}: {e}") from e
    model = model.to_empty(device=device)
    model.load_state_dict(state, strict=not cfg.tie_word_embeddings, assign=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if dtype is not None:
        model = model.to(dtype)
    return model


def _read_safetensors(f: Path) -> dict[str, torch.Tensor]:
    """All tensors of one file; a truncated, corrupt or unreadable file is a CheckpointError naming it (safetensors'
    own error says only what broke, not where)."""
    try:
        return load_file(str(f))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"checkpoint file {f}: not a readable safetensors file (truncated or corrupt?): {e}"
                              ) from e
