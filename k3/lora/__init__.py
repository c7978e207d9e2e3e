"""k3.lora: LoRA adapters for K3 (train and serve), adapter-only safetensors files, multi-LoRA batches."""
from k3.lora.adapter import LoRAAdapter, LoRAError
from k3.lora.config import (
    DEFAULT_TARGETS,
    PRESET_RANKS,
    TARGET_GROUPS,
    LoRAConfig,
    Target,
    candidate_targets,
    resolve_targets,
)
from k3.lora.manager import LoRAManager

__all__ = [
    "DEFAULT_TARGETS",
    "LoRAAdapter",
    "LoRAConfig",
    "LoRAError",
    "LoRAManager",
    "PRESET_RANKS",
    "TARGET_GROUPS",
    "Target",
    "candidate_targets",
    "resolve_targets",
]
