"""benchmarks/engine_ops.py counts what one decode step launches (the figure the host-bound engine step on the GPU
is driven down by): the count must be reproducible, attribute ops to the model's modules and to the engine, and
grow with the model's depth, or it measures nothing."""
import pytest

from benchmarks.engine_ops import OpsConfig, decode_step_ops
from k3.config import K3Config
from k3.model import K3ForCausalLM


@pytest.fixture(scope="module")
def model():
    return K3ForCausalLM(K3Config.preset("tiny")).eval()


def test_one_decode_step_is_counted_reproducibly_and_by_module(model):
    cfg = OpsConfig(rows=2, decode_batch=4)
    a, b = decode_step_ops(model, cfg), decode_step_ops(model, cfg)
    assert a == b
    assert a["aten_ops"] > a["aten_ops_not_views"] > 0
    mods = a["ops_by_module_not_views"]
    assert {"KimiDeltaAttention", "GatedMLA", "engine (outside the model)"} <= set(mods)
    assert sum(mods.values()) == a["aten_ops_not_views"]
    assert a["device_to_host_copies"] == 0   # CPU: nothing to copy back


def test_a_deeper_model_launches_more_per_step(model):
    cfg = OpsConfig(rows=2, decode_batch=4)
    cfg4 = K3Config.preset("tiny")
    shallow = K3ForCausalLM(cfg4.replace(num_hidden_layers=4, linear_attn_config={
        **cfg4.linear_attn_config, "kda_layers": [1, 2, 3], "full_attn_layers": [4]})).eval()
    assert decode_step_ops(shallow, cfg)["aten_ops"] < decode_step_ops(model, cfg)["aten_ops"]
