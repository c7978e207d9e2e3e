import json

import pytest

from k3.config import ConfigError, K3Config
from k3.model import count_parameters


def test_presets_keep_k3_structure():
    for name in ("tiny", "small", "k3"):
        cfg = K3Config.preset(name)
        n = cfg.num_hidden_layers
        kda = cfg.linear_attn_config["kda_layers"]
        full = cfg.linear_attn_config["full_attn_layers"]
        assert len(kda) == 3 * (len(full) - 1) or len(kda) == 3 * len(full), name  # 3:1 (+ the final MLA layer)
        assert n in full, f"{name}: last layer must be MLA"
        assert cfg.attn_res_block_size is not None and cfg.attn_res_block_size < n
        assert not cfg.is_moe_layer(0) and all(cfg.is_moe_layer(i) for i in range(1, n))
        assert cfg.num_shared_experts > 0 and cfg.routed_expert_hidden_size == cfg.hidden_size // 2


def test_parameter_counts():
    k3 = count_parameters(K3Config.preset("k3"))
    assert abs(k3["total"] - 2.78e12) / 2.78e12 < 0.005, k3  # published: ~2.78T
    assert 100e9 < k3["active"] < 110e9, k3                     # ~105B active
    assert 100e6 <= count_parameters(K3Config.preset("small"))["total"] <= 300e6
    assert count_parameters(K3Config.preset("tiny"))["total"] < 5e6


def test_published_k3_layout():
    cfg = K3Config.preset("k3")
    assert len(cfg.linear_attn_config["kda_layers"]) == 69
    assert len(cfg.linear_attn_config["full_attn_layers"]) == 24
    assert cfg.linear_attn_config["full_attn_layers"][-2:] == [92, 93]
    assert (cfg.num_experts, cfg.num_experts_per_token, cfg.num_shared_experts) == (896, 16, 2)


def test_from_pretrained_accepts_kimi_k3_and_kimi_linear(tmp_path):
    text = K3Config.preset("tiny").to_dict()
    wrapped = {"model_type": "kimi_k3", "text_config": text, "vision_config": {"hidden_size": 8}}
    (tmp_path / "config.json").write_text(json.dumps(wrapped))
    a = K3Config.from_pretrained(tmp_path)
    b = K3Config.from_pretrained(tmp_path / "config.json")
    c = K3Config.from_dict(text)
    assert a == b == c == K3Config.preset("tiny")


@pytest.mark.parametrize("change, field", [
    ({"linear_attn_config": {"kda_layers": [1, 2, 3, 4], "full_attn_layers": [4, 5, 6, 7, 8]}}, "overlap"),
    ({"linear_attn_config": {"kda_layers": [1, 2], "full_attn_layers": [8]}}, "neither"),
    ({"linear_attn_config": {"head_dim": 512}}, "linear_attn_config.head_dim"),
    ({"num_experts_per_token": 99}, "num_experts_per_token"),
    ({"linear_attn_config": {"gate_lower_bound": -9.0}}, "gate_lower_bound"),
    ({"hidden_act": "silu"}, "hidden_act"),
    ({"linear_attn_config": {"kda_layers": [0, 1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8]}}, "1-based"),
])
def test_validation_names_the_field(change, field):
    d = K3Config.preset("tiny").to_dict()
    for k, v in change.items():
        d[k] = {**d[k], **v} if isinstance(v, dict) else v
    with pytest.raises(ConfigError, match=field):
        K3Config.from_dict(d)


def test_wrong_model_type():
    with pytest.raises(ConfigError, match="model_type"):
        K3Config.from_dict({"model_type": "llama"})
    with pytest.raises(ConfigError, match="preset"):
        K3Config.preset("huge")
