"""benchmarks/train_step.py's CPU smoke mode (the GPU run drives the same code at K3 width)."""
from __future__ import annotations

import json

from benchmarks.train_step import StepConfig, model_config, run
from k3.config import K3Config


def test_train_step_smoke_writes_both_kernel_sets(tmp_path):
    out = tmp_path / "train_step.json"
    run(StepConfig(layers=4, seq_len=32, steps=1, warmup=1, dtype="float32", smoke=True), str(out))
    result = json.loads(out.read_text())
    assert result["benchmark"] == "train_step" and result["device"] == "cpu" and result["commit"]
    assert set(result["rows"]) == {"ours", "reference"}
    for row in result["rows"].values():
        assert row["tokens_per_s"] > 0 and row["flops_per_token"] > 0 and row["loss_first"] > 0
    # CPU: ours dispatches to the same references, so the two runs train identically
    assert result["rows"]["ours"]["loss_first"] == result["rows"]["reference"]["loss_first"]


def test_gpu_model_is_k3_width_with_few_layers():
    cfg, k3 = model_config(StepConfig()), K3Config.preset("k3")
    assert (cfg.hidden_size, cfg.kda_num_heads, cfg.num_attention_heads, cfg.num_experts_per_token) == (
        k3.hidden_size, k3.kda_num_heads, k3.num_attention_heads, k3.num_experts_per_token)
    assert cfg.num_hidden_layers == 4 and not cfg.is_kda_layer(3) and cfg.is_kda_layer(0)
