import dataclasses
import json
import re

import pytest

from k3.config import (HF_METADATA_KEYS, MOE_ONLY_FIELDS, REQUIRED_FIELDS, REQUIRED_LINEAR_ATTN_KEYS, ConfigError,
                       K3Config)
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


# ---------------------------------------------------------------- from_dict strictness (hardening)


def _tiny_dict() -> dict:
    return K3Config.preset("tiny").to_dict()


@pytest.mark.parametrize("name", REQUIRED_FIELDS + tuple(f"linear_attn_config.{k}" for k in REQUIRED_LINEAR_ATTN_KEYS))
def test_every_required_field_is_required(name):
    d = _tiny_dict()
    if name.startswith("linear_attn_config."):
        del d["linear_attn_config"][name.split(".", 1)[1]]
    else:
        del d[name]
    with pytest.raises(ConfigError, match=rf"^{re.escape(name)}: required but missing"):
        K3Config.from_dict(d)


def test_missing_fields_are_all_named_at_once_and_never_filled_with_k3_values():
    d = _tiny_dict()
    for name in ("hidden_size", "vocab_size"):
        del d[name]
    del d["linear_attn_config"]["num_heads"]
    with pytest.raises(ConfigError) as e:
        K3Config.from_dict(d)
    assert str(e.value).startswith("vocab_size, hidden_size, linear_attn_config.num_heads: required but missing")


def test_dense_config_needs_no_moe_fields():
    """A dense kimi_linear config says `num_experts: null` and may leave the MoE sizes out or null."""
    d = {k: v for k, v in _tiny_dict().items() if k not in MOE_ONLY_FIELDS}
    d |= {"num_experts": None, "num_experts_per_token": None, "moe_intermediate_size": None}
    cfg = K3Config.from_dict(d)
    assert cfg.num_experts == 0 and cfg.moe_layer_ids == []


@pytest.mark.parametrize("key, message", [
    ("hiden_size", "hiden_size: unknown field (did you mean 'hidden_size'?)"),
    ("rms_norm_epsilon", "rms_norm_epsilon: unknown field (did you mean 'rms_norm_eps'?)"),
    ("zzz", "zzz: unknown field"),
])
def test_unknown_field_is_named(key, message):
    d = _tiny_dict() | {key: 1}
    with pytest.raises(ConfigError, match=re.escape(message)):
        K3Config.from_dict(d)


def test_unknown_linear_attn_key_is_named():
    d = _tiny_dict()
    d["linear_attn_config"]["num_head"] = 2
    with pytest.raises(ConfigError, match=re.escape("linear_attn_config.num_head: unknown field (did you mean "
                                                    "'num_heads'?)")):
        K3Config.from_dict(d)


def test_published_metadata_and_aliases_are_accepted():
    """A text config as Hugging Face and the K3 release write it: metadata keys, DeepSeek-style MoE names, an eos
    list; it is the same config."""
    d = _tiny_dict()
    d["n_routed_experts"] = d.pop("num_experts")
    d["num_experts_per_tok"] = d.pop("num_experts_per_token")
    d["eos_token_id"] = [2, 5]
    d |= {"architectures": ["KimiLinearForCausalLM"], "auto_map": {"AutoConfig": "configuration_kimi_k3.X"},
          "dtype": "bfloat16", "torch_dtype": "bfloat16", "transformers_version": "4.57.1", "use_cache": True,
          "num_key_value_heads": 2, "use_grouped_topk": True, "num_nextn_predict_layers": 0,
          "quantization_config": {"quant_method": "compressed-tensors"}, "initializer_range": 0.02,
          "_name_or_path": "moonshotai/x", "rope_theta": 10000.0, "rope_scaling": None}
    assert set(d) - {f.name for f in dataclasses.fields(K3Config)} - {"n_routed_experts", "num_experts_per_tok"} \
        <= HF_METADATA_KEYS
    assert K3Config.from_dict(d) == K3Config.preset("tiny").replace(eos_token_id=2)


@pytest.mark.parametrize("change, message", [
    ({"rms_norm_eps": "1e-5"}, "rms_norm_eps: expected float, got str ('1e-5')"),
    ({"vocab_size": True}, "vocab_size: expected int, got bool (True)"),
    ({"hidden_size": 128.0}, "hidden_size: expected int, got float (128.0)"),
    ({"hidden_size": "128"}, "hidden_size: expected int, got str ('128')"),
    ({"kv_lora_rank": None}, "kv_lora_rank: expected int, got null (None)"),
    ({"routed_expert_hidden_size": "64"}, "routed_expert_hidden_size: expected int or null, got str ('64')"),
    ({"tie_word_embeddings": 0}, "tie_word_embeddings: expected bool, got int (0)"),
    ({"hidden_act": None}, "hidden_act: expected str, got null (None)"),
    ({"linear_attn_config": [1, 2]}, "linear_attn_config: expected dict, got list ([1, 2])"),
    ({"linear_attn_config": None}, "linear_attn_config: expected dict, got null (None)"),
    ({"linear_attn_config": {"num_heads": "2"}}, "linear_attn_config.num_heads: expected int, got str ('2')"),
    ({"linear_attn_config": {"head_dim": True}}, "linear_attn_config.head_dim: expected int, got bool (True)"),
    ({"linear_attn_config": {"gate_lower_bound": "-5"}},
     "linear_attn_config.gate_lower_bound: expected float or null, got str ('-5')"),
    ({"linear_attn_config": {"use_full_rank_gate": 1}},
     "linear_attn_config.use_full_rank_gate: expected bool, got int (1)"),
    ({"linear_attn_config": {"kda_layers": "1,2,3"}}, "linear_attn_config.kda_layers: expected list, got str"),
    ({"linear_attn_config": {"kda_layers": [True, 2, 3, 5, 6, 7]}}, "linear_attn_config.kda_layers: layer ids"),
    ({"num_nextn_predict_layers": 1}, "num_nextn_predict_layers: multi-token-prediction layers are not modelled"),
    ({"mla_use_nope": False}, "mla_use_nope: K3's MLA is NoPE"),
    ({"n_routed_experts": 16}, "n_routed_experts: 16 conflicts with num_experts=8"),
])
def test_wrong_type_or_value_names_the_field_and_both_types(change, message):
    d = _tiny_dict()
    for k, v in change.items():
        d[k] = {**d[k], **v} if isinstance(v, dict) else v
    with pytest.raises(ConfigError, match=re.escape(message)):
        K3Config.from_dict(d)


def test_int_is_a_float_and_null_only_where_allowed():
    cfg = K3Config.from_dict(_tiny_dict() | {"rms_norm_eps": 1, "routed_scaling_factor": 2, "q_lora_rank": None,
                                             "attn_res_block_size": None})
    assert (cfg.rms_norm_eps, cfg.routed_scaling_factor, cfg.q_lora_rank, cfg.attn_res_block_size) == (1, 2, None,
                                                                                                        None)
    d = _tiny_dict()
    d["linear_attn_config"]["gate_lower_bound"] = -4  # int where a float is expected; null picks the default gate
    assert K3Config.from_dict(d).gate_lower_bound == -4.0


def test_direct_construction_keeps_k3_defaults_and_checks_types():
    assert K3Config().hidden_size == 7168 and K3Config.preset("k3") == K3Config()
    assert K3Config.preset("tiny").replace(hidden_size=96).hidden_size == 96
    with pytest.raises(ConfigError, match=re.escape("rms_norm_eps: expected float, got str ('1e-5')")):
        K3Config.preset("tiny").replace(rms_norm_eps="1e-5")
    with pytest.raises(ConfigError, match=re.escape("linear_attn_config.num_heads: expected int, got float")):
        K3Config(linear_attn_config={"num_heads": 2.0})


@pytest.mark.parametrize("text, message", [
    ("{", "is not valid JSON (Expecting property name enclosed in double quotes at line 1, column 2)"),
    ("", "is not valid JSON"),
    ("[1, 2]", "config: expected a dict, got list"),
    (json.dumps({"model_type": "kimi_linear", "vocab_size": 512}), "hidden_size"),
])
def test_from_pretrained_names_the_file(tmp_path, text, message):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        K3Config.from_pretrained(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value)


def test_from_pretrained_missing_or_unreadable(tmp_path):
    with pytest.raises(ConfigError, match=re.escape(f"config: {tmp_path / 'nope' / 'config.json'} does not exist")):
        K3Config.from_pretrained(tmp_path / "nope" / "config.json")
    with pytest.raises(ConfigError, match=re.escape(f"config: {tmp_path / 'config.json'} does not exist")):
        K3Config.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ConfigError, match=re.escape(f"config: cannot read {tmp_path / 'config.json'}")):
        K3Config.from_pretrained(tmp_path)
