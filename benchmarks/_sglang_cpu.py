"""SGLang 0.5.23 on a CPU box for the benchmarks that run its classes (in .venv-sglang), what the SGLang tests'
conftest does for pytest (tests/plugins/sglang_k3/conftest.py says why): our CPU platform through its entry point,
and the two torchvision operator schemas its PyPI build needs before import. Import this before SGLang."""
from __future__ import annotations

import importlib.util
import os

import torch

os.environ.setdefault("SGLANG_PLATFORM", "k3_cpu")
if importlib.util.find_spec("torchvision") is not None and not torch.cuda.is_available():
    _TORCHVISION_SCHEMAS = torch.library.Library("torchvision", "DEF")
    _TORCHVISION_SCHEMAS.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _TORCHVISION_SCHEMAS.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
