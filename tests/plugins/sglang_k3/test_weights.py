"""XOR-delta weight updates through SGLang's update path: the real scheduler-side session manager
(`SchedulerWeightUpdaterManager`: begin/update/end, version recording, cache flush) over the real model-runner
`WeightUpdater`, whose `update_weights_from_tensor` / `_from_disk` carry our AROUND hook (via `load_plugins()`).

Fakes, and why: SGLang's `TpModelWorker` and `Scheduler` need a CUDA model runner; only the three things the
manager asks of them are stood in for (`weight_update_runners`, `deserialize_own_rank` as identity: the payload
tensor is already in this process; `record_weight_version_change`). The model is a small torch module whose
`load_weights` maps checkpoint names onto a fused parameter, as SGLang models do.
"""
from types import SimpleNamespace

import pytest
import torch

from _sglang_helpers import load_k3_plugins, server_args

load_k3_plugins()

from sglang.srt.managers.io_struct import (  # noqa: E402
    BeginWeightUpdateReqInput, EndWeightUpdateReqInput, UpdateWeightFromDiskReqInput, UpdateWeightsFromTensorReqInput)
from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager  # noqa: E402
from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater  # noqa: E402

from k3.sync import WeightPublisher  # noqa: E402
from k3_sglang.weights import LOAD_FORMAT, PAYLOAD_TENSOR, served_version  # noqa: E402


class FusedQK(torch.nn.Module):
    """Checkpoint names q.weight / k.weight, one fused parameter (SGLang's qkv_proj pattern)."""

    def __init__(self):
        super().__init__()
        self.qk = torch.nn.Parameter(torch.zeros(2, 8, 4, dtype=torch.bfloat16), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
        self.loaded = []

    def load_weights(self, weights):
        weights = list(weights)
        self.loaded.append(sorted(n for n, _ in weights))
        for name, t in weights:
            if name == "norm.weight":
                self.norm.data.copy_(t)
            else:
                self.qk.data[0 if name == "q.weight" else 1].copy_(t)


def _checkpoint(seed):
    g = torch.Generator().manual_seed(seed)
    return {"q.weight": torch.randn(8, 4, generator=g).bfloat16(),
            "k.weight": torch.randn(8, 4, generator=g).bfloat16(),
            "norm.weight": torch.randn(4, generator=g)}


def _served(model):
    return {"q.weight": model.qk[0], "k.weight": model.qk[1], "norm.weight": model.norm}


@pytest.fixture
def engine(tmp_path, monkeypatch):
    model = FusedQK()
    runner = SimpleNamespace(weight_updater=WeightUpdater(
        tp_rank=0, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders={}, get_model=lambda: model,
        update_model_fields=lambda *a, **k: None, recapture_cuda_graph=lambda: None, get_model_runner=lambda: None))
    versions = []
    tp_worker = SimpleNamespace(weight_update_runners=lambda: [("target", runner)],
                                deserialize_own_rank=lambda serialized: serialized)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    # one rank: the manager's barriers run on the default (gloo, world 1) group instead of SGLang's TP group
    monkeypatch.setattr(SchedulerWeightUpdaterManager, "__post_init__",
                        lambda self: setattr(self, "tp_cpu_group", None))
    manager = SchedulerWeightUpdaterManager(
        tp_worker=tp_worker, draft_worker=None, memory_saver_adapter=None, flush_cache=lambda **kw: True,
        is_fully_idle=lambda **kw: True,
        scheduler=SimpleNamespace(record_weight_version_change=lambda new_version: versions.append(new_version)))
    with server_args():
        yield SimpleNamespace(model=model, manager=manager, versions=versions)


def _push(engine, payload: bytes, version: str):
    m = engine.manager
    assert m.begin_weight_update(BeginWeightUpdateReqInput()).success
    out = m.update_weights_from_tensor(UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=[(PAYLOAD_TENSOR, torch.frombuffer(bytearray(payload), dtype=torch.uint8))],
        load_format=LOAD_FORMAT, weight_version=version, flush_cache=True))
    assert m.end_weight_update(EndWeightUpdateReqInput()).success
    return out


def _equal(model, ckpt):
    return all(torch.equal(_served(model)[n], t) for n, t in ckpt.items())


def test_full_then_deltas_are_served_bit_exact_through_load_weights(engine):
    pub = WeightPublisher(full_every=100)
    for version in range(3):
        ckpt = _checkpoint(version)
        out = _push(engine, pub.publish(ckpt, version), f"v{version}")
        assert out.success, out.message
        assert _equal(engine.model, ckpt) and served_version(engine.model) == version
    assert engine.versions == ["v0", "v1", "v2"]
    assert engine.model.loaded[-1] == ["k.weight", "norm.weight", "q.weight"]  # ended in model.load_weights


def _corrupt(payload: bytes) -> bytes:
    bad = bytearray(payload)
    bad[len(bad) // 2] ^= 0xFF
    return bytes(bad)


@pytest.mark.parametrize("fault", ["bad_checksum", "wrong_base_version", "wrong_shape", "delta_first",
                                   "wrong_name"])
def test_a_refused_payload_leaves_the_served_version_and_the_next_good_one_applies(engine, fault):
    pub = WeightPublisher(full_every=100)
    v0 = _checkpoint(0)
    first = pub.publish(v0, 0)
    v1 = _checkpoint(1)
    good = pub.publish(v1, 1)
    if fault == "bad_checksum":
        bad = _corrupt(good)
    elif fault == "wrong_base_version":
        bad = WeightPublisher(full_every=100, chain=pub.chain)
        bad.publish(_checkpoint(7), 5)
        bad = bad.publish(_checkpoint(8), 6)  # a delta from version 5: the engine serves 0
    elif fault == "wrong_shape":
        bad = WeightPublisher(full_every=100).publish({**v1, "norm.weight": torch.randn(5)}, 1, full=True)
    elif fault == "wrong_name":
        bad = WeightPublisher(full_every=100).publish({**v1, "extra.weight": torch.randn(2)}, 1, full=True)
    if fault == "delta_first":  # nothing served yet: a delta cannot apply
        out = _push(engine, good, "v1")
        assert not out.success and "full snapshot" in out.message and served_version(engine.model) is None
        assert engine.versions == [] and engine.model.loaded == []
        assert _push(engine, first, "v0").success and _equal(engine.model, v0)
        return
    assert _push(engine, first, "v0").success
    loads = len(engine.model.loaded)
    out = _push(engine, bad, "v1-bad")
    assert not out.success and "still serving version 0" in out.message, out.message
    assert _equal(engine.model, v0) and served_version(engine.model) == 0
    assert engine.versions == ["v0"] and len(engine.model.loaded) == loads  # nothing recorded, nothing loaded
    out = _push(engine, good, "v1")
    assert out.success, out.message
    assert _equal(engine.model, v1) and engine.versions == ["v0", "v1"]


def test_update_outside_a_session_is_refused_by_sglang_and_from_disk_works(engine, tmp_path):
    pub = WeightPublisher(full_every=100)
    payload = pub.publish(_checkpoint(0), 0)
    out = engine.manager.update_weights_from_tensor(UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=[(PAYLOAD_TENSOR, torch.frombuffer(bytearray(payload), dtype=torch.uint8))],
        load_format=LOAD_FORMAT))
    assert not out.success and "begin_weight_update" in out.message and served_version(engine.model) is None
    path = tmp_path / "v0.k3sync"
    path.write_bytes(payload)
    out = engine.manager.update_weights_from_disk(UpdateWeightFromDiskReqInput(
        model_path=str(path), load_format=LOAD_FORMAT, weight_version="v0"))
    assert out.success, out.message
    assert _equal(engine.model, _checkpoint(0)) and engine.versions == ["v0"]
    out = engine.manager.update_weights_from_disk(UpdateWeightFromDiskReqInput(
        model_path=str(tmp_path / "missing"), load_format=LOAD_FORMAT))
    assert not out.success and "model_path" in out.message and served_version(engine.model) == 0
