"""Running TorchTitan 0.3.0's own trainer on CPU with gloo (CI on machines without a GPU), without editing it.

`use_cpu()` is called by the `*_cpu` config functions (config_registry.py): TorchTitan's config manager calls the
config function after importing torchtitan.train and before the Trainer is built, which is late enough to rebind
what TorchTitan bound at import and early enough for everything that reads it:

- `torchtitan.tools.utils.get_device_info()` picks "cuda" when no accelerator is found, and five modules copy
  `device_type` / `device_module` at import: all are rebound to "cpu" and `CPUDeviceModule` (torch.cpu has no
  memory statistics; the memory monitor reads them).
- `torch.distributed.set_timeout` is missing in torch 2.13: aliased to `distributed_c10d._set_pg_timeout`.

The rest of the CPU set-up is configuration (config_registry.cpu_trainer_settings): fp32 parameters, the
`partial_dtensor` SPMD backend (FSDP2 in torch 2.13), gloo-safe SUM reductions (gloo has no PREMUL_SUM; applied in
parallelize.py), CUDA graphs off, the byte tokenizer and the local dataset of data.py.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

import torch

# modules that copy device_type / device_module at import (torchtitan 0.3.0)
_COPIES = ("torchtitan.tools.utils", "torchtitan.components.metrics", "torchtitan.models.common.token_dispatcher",
           "torchtitan.distributed.parallel_dims", "torchtitan.distributed.utils")


@dataclass(frozen=True)
class _CPUProperties:
    name: str
    total_memory: int


class CPUDeviceModule:
    """The subset of the torch.cuda interface TorchTitan's trainer calls, for the CPU (memory statistics are not
    tracked: zero)."""

    @staticmethod
    def set_device(device) -> None:
        pass

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def synchronize(device=None) -> None:
        pass

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device=None) -> _CPUProperties:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return _CPUProperties("cpu", int(pages * page))

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def memory_stats(device=None) -> dict[str, int]:
        return {}

    @staticmethod
    def is_available() -> bool:
        return True


def use_cpu() -> None:
    """Rebind TorchTitan's device globals to the CPU and alias the missing torch.distributed API (idempotent)."""
    module = CPUDeviceModule()
    for name in _COPIES:
        mod = importlib.import_module(name)
        if hasattr(mod, "device_type"):
            mod.device_type = "cpu"
        if hasattr(mod, "device_module"):
            mod.device_module = module
    metrics = importlib.import_module("torchtitan.components.metrics")
    init = metrics.DeviceMemoryMonitor.__init__
    if init.__defaults__ and init.__defaults__[0] != "cpu:0":  # its default argument was bound at import too
        init.__defaults__ = ("cpu:0",)
    dist = torch.distributed
    if not hasattr(dist, "set_timeout"):
        from torch.distributed import distributed_c10d

        dist.set_timeout = distributed_c10d._set_pg_timeout
