"""k3.model's latent MoE on the fused kernels (k3.model.ops.fused_moe): the CPU path never reaches them (it stays
bit for bit the torch code the main job and its tests depend on); with the kernels switched on (interpreter on CPU,
the default on CUDA) the layer gives the torch path's outputs, ids and gradients, replays forced routing, and falls
back to the torch loop where a `project` override (LoRA adapters, expert-parallel shards) is installed."""
import copy
import os

import pytest
import torch

if not torch.cuda.is_available():  # (tests/conftest.py sets it too, before anything imports triton)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from k3.config import K3Config  # noqa: E402
from k3.model import ops  # noqa: E402
from k3.model.moe import LatentMoE  # noqa: E402


@pytest.fixture(scope="module")
def layer():
    torch.manual_seed(0)
    moe = LatentMoE(K3Config.preset("tiny"))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.1) if p.dim() > 1 else p.uniform_(-0.02, 0.02)
        moe.gate.weight.normal_(0, 0.3)
    x = torch.randn(2, 7, moe.gate.weight.shape[1])
    return moe, x


def _run(moe, x, forced=None, device="cpu"):
    """Forward + backward of a copy of the layer on `device` -> (y, ids, dx, parameter grads), on the CPU."""
    moe = copy.deepcopy(moe).to(device)
    xl = x.to(device).requires_grad_()
    y, idx = moe(xl, forced.to(device) if forced is not None else None)
    y.square().sum().backward()
    grads = {n: p.grad.cpu() for n, p in moe.named_parameters() if p.grad is not None}
    return y.detach().cpu(), idx.cpu(), xl.grad.cpu(), grads


def _fused(monkeypatch):
    """Where the fused kernels run: CUDA by default; on CPU through the interpreter with the switch on."""
    if torch.cuda.is_available():
        return "cuda"
    monkeypatch.setattr(ops, "MOE_KERNELS_ON_CPU", True)
    return "cpu"


def test_cpu_path_does_not_use_the_kernels(layer, monkeypatch):
    moe, x = layer
    assert not ops.fused_moe(x)

    def _refuse(*a, **k):
        raise AssertionError("the CPU path reached the fused MoE kernels")
    monkeypatch.setattr(ops, "moe_router", _refuse)
    monkeypatch.setattr(ops, "moe_experts", _refuse)
    moe(x)  # a recorded (training) forward
    with torch.no_grad():  # the inference forward (batch-invariant row blocks)
        moe(x)


def test_fused_layer_matches_torch_path(layer, monkeypatch):
    moe, x = layer
    y_ref, idx_ref, dx_ref, g_ref = _run(moe, x)
    dev = _fused(monkeypatch)
    assert ops.fused_moe(x.to(dev))
    y, idx, dx, g = _run(moe, x, device=dev)
    assert torch.equal(idx, idx_ref)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx, dx_ref, atol=1e-5, rtol=1e-4)
    assert g.keys() == g_ref.keys()
    for name in g:
        torch.testing.assert_close(g[name], g_ref[name], atol=1e-5, rtol=1e-4, msg=name)
    # Router Replay through the layer: forced ids in, the same ids out, weights from the current router
    forced = torch.roll(idx_ref, 1, dims=-1)
    forced[0, 0] = -1  # this token routes freely
    y_f, idx_f, _, _ = _run(moe, x, forced, device=dev)
    monkeypatch.setattr(ops, "MOE_KERNELS_ON_CPU", False)
    y_fr, idx_fr, _, _ = _run(moe, x, forced)
    assert torch.equal(idx_f, idx_fr) and torch.equal(idx_f[0, 1:], forced[0, 1:])
    torch.testing.assert_close(y_f, y_fr, atol=1e-5, rtol=1e-5)


def test_project_override_keeps_the_loop(layer, monkeypatch):
    moe, x = layer
    dev = _fused(monkeypatch)
    moe, x = copy.deepcopy(moe).to(dev), x.to(dev)
    calls = []

    def project(which, expert, tok, h, weight):
        calls.append(which)
        return ops.linear(h, weight)
    monkeypatch.setattr(moe.experts, "project", project, raising=False)
    moe(x)
    assert calls, "an instance `project` override (adapters) must keep the per-expert loop"
