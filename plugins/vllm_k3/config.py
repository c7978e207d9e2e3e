"""The K3 config as vLLM reads it: our own `model_type` / architecture names and the `k3` config format.

vLLM's in-tree names (`kimi_linear`, `kimi_k3`, `KimiLinearForCausalLM`) route to its GPU-only K3 and to its MLA
detection (`is_deepseek_mla` by model_type), so a checkpoint saved by `k3.model` (model_type `kimi_linear`, or a
published `kimi_k3` config) is read by `K3ConfigParser` (`config_format="k3"`): `K3Config.from_pretrained` checks
it strictly, and the parser hands vLLM a `K3VllmConfig` that names our architecture and says which layers are
linear attention (`layer_types`, what vLLM's hybrid accounting reads)."""
from __future__ import annotations

from pathlib import Path

from transformers import PretrainedConfig

from k3.config import K3Config

MODEL_TYPE = "k3_vllm"
ARCHITECTURE = "K3VllmForCausalLM"
CONFIG_FORMAT = "k3"


class K3VllmConfig(PretrainedConfig):
    """K3Config's fields as a Hugging Face config (what vLLM's ModelConfig holds), plus vLLM's derived names."""

    model_type = MODEL_TYPE

    def __init__(self, k3: dict | None = None, **kwargs) -> None:
        k3 = dict(k3 or {})
        if k3:
            cfg = K3Config.from_dict({**k3, "model_type": "kimi_linear"})
            fields = cfg.to_dict()
            fields.pop("model_type")
            for name, value in fields.items():
                kwargs.setdefault(name, value)
            kwargs.setdefault("layer_types", ["linear_attention" if cfg.is_kda_layer(i) else "full_attention"
                                              for i in range(cfg.num_hidden_layers)])
            kwargs.setdefault("num_experts_per_tok", cfg.num_experts_per_token)
            kwargs.setdefault("num_key_value_heads", cfg.num_attention_heads)
            kwargs.setdefault("architectures", [ARCHITECTURE])
        self.k3 = k3
        super().__init__(**kwargs)

    def k3_config(self) -> K3Config:
        """The K3Config this was built from (checked again: a config edited after loading fails here)."""
        return K3Config.from_dict({**self.k3, "model_type": "kimi_linear"})


def k3_dict(path: str | Path) -> dict:
    """The text config of a K3 checkpoint directory (kimi_linear or kimi_k3), validated, as K3Config's fields."""
    d = K3Config.from_pretrained(path).to_dict()
    d.pop("model_type")
    return d


def parser_class():
    """vLLM's ConfigParserBase subclass for `config_format="k3"` (built lazily: k3_vllm.config imports no vLLM)."""
    from vllm.transformers_utils.config_parser_base import ConfigParserBase

    class K3ConfigParser(ConfigParserBase):
        def parse(self, model, trust_remote_code, revision=None, code_revision=None, **kwargs):
            fields = k3_dict(model)
            config = K3VllmConfig(k3=fields)
            return config.to_dict(), config

    return K3ConfigParser
