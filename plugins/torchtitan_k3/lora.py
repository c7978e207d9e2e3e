"""LoRA on the K3 modules inside TorchTitan, with k3.lora's adapters (the same hooks, targets and adapter files
as the rest of the project): the base is frozen, the adapter is registered as the model's `lora` submodule so
TorchTitan's optimizer (trainable parameters only), FSDP (the root unit) and DCP checkpoints see it, and it is
selected for every forward. `save_adapter` / `load_adapter` write and read adapter-only safetensors files."""
from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from k3.lora import LoRAAdapter, LoRAConfig, LoRAManager

ADAPTER_NAME = "policy"


def attach_lora(model: nn.Module, config: LoRAConfig, seed: int = 0) -> LoRAAdapter:
    for p in model.parameters():
        p.requires_grad_(False)
    manager = LoRAManager(model)
    adapter = manager.create(ADAPTER_NAME, config, seed=seed)
    model.lora = adapter
    manager.activate(ADAPTER_NAME)
    return adapter


@torch.no_grad()
def reset_lora(adapter: LoRAAdapter) -> None:
    """k3.lora's initialisation (A ~ U(+-1/sqrt(in)), B = 0), in place (after a meta build and `to_empty`)."""
    for name, t in adapter.targets.items():
        bound = 1.0 / math.sqrt(t.in_features)
        adapter.A(name).uniform_(-bound, bound)
        adapter.B(name).zero_()


def save_adapter(model: nn.Module, path: str | Path) -> None:
    """The adapter alone (no base weights), gathered from FSDP shards when sharded."""
    adapter = _adapter(model)
    tensors = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach() for k, v in adapter.tensors().items()}
    plain = LoRAAdapter(adapter.config, adapter.targets, device="cpu")
    plain.load_tensors(tensors)
    plain.save(path)


def load_adapter(model: nn.Module, path: str | Path) -> None:
    """Read an adapter-only file into the model's adapter (all or nothing; errors name the file and tensors)."""
    adapter = _adapter(model)
    adapter.load_tensors(LoRAAdapter.load(path, model).tensors())


def _adapter(model: nn.Module) -> LoRAAdapter:
    adapter = getattr(model, "lora", None)
    if not isinstance(adapter, LoRAAdapter):
        raise ValueError("model: no LoRA adapter attached (K3TitanModel.Config.lora is None)")
    return adapter


def export_adapter(checkpoint_dir: str | Path, model: nn.Module, path: str | Path) -> None:
    """An adapter-only file from a TorchTitan DCP checkpoint (any step folder of a LoRA run, written by any number
    of ranks): reads only the adapter's tensors into `model`'s adapter (one process, no process group), then
    `save_adapter`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    adapter = _adapter(model)
    state = {f"lora.{k}": v for k, v in adapter.state_dict().items()}
    dcp.load(state, checkpoint_id=str(checkpoint_dir), planner=DefaultLoadPlanner(allow_partial_load=True))
    adapter.load_state_dict({k[len("lora."):]: v for k, v in state.items()})
    save_adapter(model, path)
