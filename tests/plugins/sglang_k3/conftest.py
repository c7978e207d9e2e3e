"""SGLang 0.5.23 on CPU, for every test here (runs in .venv-sglang: `make test-sglang`).

Three facts about the wheel on a machine without CUDA, each fixed here before SGLang is imported (pytest imports
this file first), without touching SGLang's files:
1. Platform: `get_device()` raises without an accelerator; our out-of-tree CPU platform (`k3_sglang.platform`,
   entry point `sglang.srt.platforms: k3_cpu`) answers "cpu". `SGLANG_PLATFORM=k3_cpu` makes the discovery load
   only that entry point and fail loudly if it is not installed.
2. torchvision: SGLang imports it (multimodal configs); the PyPI build's C ops do not load beside the CPU torch, and
   its Python then registers fake kernels for `torchvision::nms` / `qnms`, which fails unless their schemas exist.
   We define the two schemas (no kernels: nothing here calls them).
3. Triton: SGLang's kernels run here only under `TRITON_INTERPRET=1` (fp32). The interpreter patches `tl`'s
   builtins while a kernel runs; SGLang's module-level aliases (`exp = tl.exp` in `fla/op.py`, imported by the
   kernels) keep the unpatched builtin, so they are rebound to forwarders (`rebind_triton_aliases`).
4. `current_platform.init_backend()` runs once, as SGLang's model runner does for an out-of-tree platform.
The kits also save/restore `torch.cuda`'s RNG state, which raises on a CPU build: a no-op stand-in is installed
when CUDA is absent (the CPU generator is seeded and restored by the kits themselves).
"""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():  # on the GPU machine (only test_kda_layouts.py runs there) Triton compiles
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("SGLANG_PLATFORM", "k3_cpu")

sys.path.insert(0, os.path.dirname(__file__))  # _sglang_helpers, for the test modules

if importlib.util.find_spec("sglang") is None:  # outside .venv-sglang: only the SGLang-free layout tests
    collect_ignore_glob = [f for f in os.listdir(os.path.dirname(__file__))
                           if f.startswith("test_") and f != "test_kda_layouts.py"]
else:
    if importlib.util.find_spec("torchvision") is not None:
        _TORCHVISION_SCHEMAS = torch.library.Library("torchvision", "DEF")
        _TORCHVISION_SCHEMAS.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _TORCHVISION_SCHEMAS.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    if not torch.cuda.is_available():
        torch.cuda.get_rng_state = lambda device="cuda": torch.empty(0, dtype=torch.uint8)
        torch.cuda.set_rng_state = lambda new_state, device="cuda": None

    from _sglang_helpers import rebind_triton_aliases  # noqa: E402

    import sglang.srt.platforms as _platforms  # noqa: E402

    def pytest_configure(config):
        platform = _platforms.current_platform  # resolves through the entry point (SGLANG_PLATFORM above)
        if type(platform).__module__ != "k3_sglang.platform":
            raise pytest.UsageError(f"SGLang picked platform {type(platform).__qualname__}, not k3_sglang's CPU "
                                    "platform: is the project installed in this venv (`pip install --no-deps -e .`)?")
        platform.init_backend()  # what SGLang's model runner calls for an out-of-tree platform at import

    @pytest.fixture(autouse=True, scope="session")
    def _triton_aliases_rebound():
        """Rebinds the aliases of every SGLang Triton module imported during collection (tests importing more
        call `rebind_triton_aliases()` themselves after their imports)."""
        rebind_triton_aliases()
        yield
