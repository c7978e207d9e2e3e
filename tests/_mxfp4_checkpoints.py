"""Shared by the checkpoint tests of every venv (core, TorchTitan, vLLM): a saved checkpoint rewritten with its
routed experts in the published K3 checkpoint's format, compressed-tensors MXFP4 (`X.weight_packed` uint8
[out, in / 2] + `X.weight_scale` E8M0 [out, in / 32]). tests/ is on sys.path for every test below it (its
conftest.py has no package), so `from _mxfp4_checkpoints import ...` works from each folder."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from k3.model.adapter import WEIGHTS_FILE
from k3_kernels.moe import naive_dequant_mxfp4

# the published config's quantization block (shared/reference/k3-architecture.md: routed MXFP4, group 32)
QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "format": "mxfp4-pack-quantized",
                                  "weights": {"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group",
                                              "symmetric": True, "dynamic": False}}},
    "ignore": ["re:.*shared_experts.*", "lm_head"]}


def store_experts_as_mxfp4(ckpt: Path, seed: int = 3, exponents: tuple[int, int] = (112, 119),
                           with_quantization_config: bool = False) -> dict[str, torch.Tensor]:
    """Replace every routed expert `...experts.{e}.w{1,2,3}.weight` of ckpt's model.safetensors by random MXFP4
    codes (every code occurs) and E8M0 scales in `exponents` (2^-15..2^-8 by default: weights of the size the
    tiny model's init has, so its outputs stay tame); returns {weight name: the bf16 values the pair encodes}."""
    gen = torch.Generator().manual_seed(seed)
    hf, meant = {}, {}
    for name, t in load_file(str(ckpt / WEIGHTS_FILE)).items():
        if ".experts." in name and name.endswith(".weight"):
            out_f, in_f = t.shape
            packed = torch.randint(0, 256, (out_f, in_f // 2), generator=gen, dtype=torch.uint8)
            scales = torch.randint(*exponents, (out_f, in_f // 32), generator=gen, dtype=torch.uint8)
            base = name[: -len(".weight")]
            hf[base + ".weight_packed"], hf[base + ".weight_scale"] = packed, scales
            meant[name] = naive_dequant_mxfp4(packed, scales)
        else:
            hf[name] = t
    save_file(hf, str(ckpt / WEIGHTS_FILE), metadata={"format": "pt"})
    if with_quantization_config:
        config = json.loads((ckpt / "config.json").read_text())
        (ckpt / "config.json").write_text(json.dumps({**config, "quantization_config": QUANTIZATION_CONFIG}))
    return meant
