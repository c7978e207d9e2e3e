"""TorchTitan 0.3.0 plugin for Kimi K3 (`--module k3_torchtitan`): `model_registry(flavor) -> ModelSpec` for the
flavours k3_tiny / k3_small / k3, and `config_registry` (Trainer.Config functions, CPU variants included).

    torchrun --nproc_per_node 2 -m torchtitan.train --module k3_torchtitan --config k3_tiny_cpu
"""
from __future__ import annotations

from torchtitan.protocols.model_spec import ModelSpec

from k3.config import K3Config

from .model import K3TitanModel, nparams_and_flops
from .parallelize import ParallelismError, parallelize_k3
from .state_dict_adapter import K3StateDictAdapter

#: TorchTitan flavour -> k3.config preset
FLAVORS = {"k3_tiny": "tiny", "k3_small": "small", "k3": "k3"}


def model_config(flavor: str) -> K3TitanModel.Config:
    if flavor not in FLAVORS:
        raise ValueError(f"flavor: unknown {flavor!r}; choose from {sorted(FLAVORS)}")
    return K3TitanModel.Config(k3=K3Config.preset(FLAVORS[flavor]))


def model_registry(flavor: str) -> ModelSpec:
    return ModelSpec(name="k3", flavor=flavor, model=model_config(flavor), parallelize_fn=parallelize_k3,
                     pipelining_fn=None, post_optimizer_build_fn=None, state_dict_adapter=K3StateDictAdapter)


__all__ = ["FLAVORS", "K3StateDictAdapter", "K3TitanModel", "ParallelismError", "model_config", "model_registry",
           "nparams_and_flops", "parallelize_k3"]
