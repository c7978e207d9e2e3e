"""k3_vllm's config side without an engine: the `k3` config format reads any checkpoint config k3.model writes
(and the published kimi_k3 layout), refuses bad ones naming the field, and the real K3 dims fit vLLM's attention."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from k3.config import ConfigError, K3Config  # noqa: E402
from k3_vllm.config import ARCHITECTURE, K3VllmConfig, parser_class  # noqa: E402
from k3_vllm.model import CPU_ATTENTION_HEAD_SIZES, K3PluginError, attention_head_size  # noqa: E402


def test_parser_reads_a_k3_checkpoint_config(tmp_path):
    K3Config.preset("tiny").save_pretrained(tmp_path)
    _, cfg = parser_class()().parse(tmp_path, trust_remote_code=False)
    assert isinstance(cfg, K3VllmConfig) and cfg.architectures == [ARCHITECTURE]
    assert cfg.k3_config() == K3Config.preset("tiny")
    assert cfg.layer_types.count("full_attention") == 2 and cfg.num_experts_per_tok == 2


def test_parser_reads_the_published_kimi_k3_layout(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k3",
                                                      "text_config": K3Config().to_dict()}))
    _, cfg = parser_class()().parse(tmp_path, trust_remote_code=False)
    k3 = cfg.k3_config()
    assert (k3.num_hidden_layers, k3.num_experts, k3.hidden_size) == (93, 896, 7168)
    assert attention_head_size(k3) == 192 in CPU_ATTENTION_HEAD_SIZES   # qk 128 + 64, v 128 padded to 192


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.pop("hidden_size"), "hidden_size: required but missing"),
    (lambda d: d.update(hidden_sise=3), "hidden_sise: unknown field"),
    (lambda d: d.update(num_experts_per_token=99), "num_experts_per_token"),
])
def test_parser_refuses_a_bad_config_naming_the_field(tmp_path, edit, match):
    d = K3Config.preset("tiny").to_dict()
    edit(d)
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match=match):
        parser_class()().parse(tmp_path, trust_remote_code=False)


def test_head_dims_beyond_vllm_attention_are_a_clear_error():
    cfg = K3Config.preset("tiny").replace(qk_nope_head_dim=600)
    with pytest.raises(K3PluginError, match="qk_nope_head_dim \\+ qk_rope_head_dim = 608"):
        attention_head_size(cfg)
    assert attention_head_size(K3Config.preset("tiny")) == 32      # qk 24, v 16
