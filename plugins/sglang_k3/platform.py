"""Out-of-tree CPU platform for SGLang 0.5.23 (entry point group `sglang.srt.platforms`).

Why it exists: SGLang's in-tree CPU platform is chosen only with `SGLANG_USE_CPU_ENGINE=1`, which also switches
its layers onto the `sgl_kernel` CPU build (not on PyPI). Without a platform, `get_device()` raises on a machine
with no accelerator. This platform reuses SGLang's own `CpuDeviceMixin` (memory, device, gloo) under the
out-of-tree identity, so SGLang's classes (pools, radix caches, the KDA backend, spec workers) run on CPU with
torch-native paths and Triton kernels under `TRITON_INTERPRET=1`, without touching SGLang's files.

It activates only where no accelerator is present (or when `SGLANG_PLATFORM=k3_cpu` names it), so installing the
distribution on a GPU host changes nothing there.
"""
from __future__ import annotations

import os

import torch

from sglang.srt.platforms.cpu import CpuDeviceMixin
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform

PLATFORM_NAME = "k3_cpu"  # the entry point's name: `SGLANG_PLATFORM=k3_cpu` selects it explicitly
PLATFORM_QUALNAME = "k3_sglang.platform.K3CpuPlatform"


class K3CpuPlatform(CpuDeviceMixin, SRTPlatform):
    """CPU device operations (SGLang's mixin) + torch-native subsystems; out-of-tree so that SGLang never routes
    it onto the `sgl_kernel` CPU ops its in-tree CPU platform assumes."""

    _enum = PlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"
    # Triton runs here only in interpreter mode; core's allocators then use their torch-native writers.
    capabilities = PlatformCapabilities(supports_triton=False, graph_capture=False)

    def get_default_attention_backend(self) -> str:
        return "torch_native"

    def get_default_speculative_draft_attention_backend(self, algorithm: str) -> str:
        return "torch_native"

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        return algorithm.upper().startswith("K3_")  # ours are plain torch + k3_kernels; SGLang's need CUDA

    def is_pin_memory_available(self, device=None) -> bool:
        return False

    def get_dispatch_key_name(self) -> str:
        return "native"

    def init_backend(self) -> None:
        """Host pools (HiCache, the routed-experts host cache) are allocated by a function keyed by device name;
        for "cpu" SGLang's default pins and `cudaHostRegister`s them, which fails without CUDA: plain memory."""
        from sglang.srt.mem_cache.pool_host.common import ALLOC_MEMORY_FUNCS

        ALLOC_MEMORY_FUNCS["cpu"] = _alloc_host_unpinned


def _alloc_host_unpinned(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    return allocator.allocate(dims, dtype=dtype, device=device)


def _accelerator_present() -> bool:
    if torch.cuda.is_available():
        return True
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return True
    mps = getattr(torch, "mps", None)
    return bool(mps is not None and torch.backends.mps.is_available())


def activate() -> str | None:
    """`sglang.srt.platforms` entry point: the platform's qualified name where it applies, else None."""
    if os.environ.get("SGLANG_PLATFORM") == PLATFORM_NAME or not _accelerator_present():
        return PLATFORM_QUALNAME
    return None
