"""The model's multi-LoRA dispatch (k3.model.ops.multi_lora / fused_multi_lora, used by k3.lora.LoRAManager):
a K3 forward and backward over rows of different adapters through the SGMV kernels equals the per-adapter torch
path (the CPU path, unchanged). On CPU the fused path is forced with the kernels under Triton's interpreter; the
`gpu` test runs the real dispatch on CUDA against the torch loop."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # (tests/conftest.py sets it too, before anything imports triton)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from k3.config import K3Config  # noqa: E402
from k3.lora import LoRAConfig, LoRAManager  # noqa: E402
from k3.model import K3ForCausalLM, ops  # noqa: E402
from k3_kernels.lora.sgmv import sgmv_lora  # noqa: E402


def _model(device):
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny")).to(device).eval()
    model.requires_grad_(False)
    lora = LoRAManager(model)
    # ranks differ (padded in the stack); "c" targets only the attention projections
    for name, rank, targets, seed in (("a", 4, ("attn", "mlp"), 1), ("b", 8, ("attn", "mlp"), 2),
                                      ("c", 8, ("attn",), 3)):
        lora.create(name, LoRAConfig(rank=rank, alpha=16.0, targets=targets, init_scale=0.05), seed=seed)
    return model, lora


def _run(model, lora, ids, selection):
    for ad in lora.adapters.values():
        ad.zero_grad(set_to_none=True)
        ad.requires_grad_(True)
    with lora.use(selection):
        logits = model(ids, use_cache=False).logits.float()
    logits.square().mean().backward()
    grads = {n: [p.grad.clone() for p in ad.parameters() if p.grad is not None] for n, ad in lora.adapters.items()}
    return logits.detach(), grads


def _compare(model, lora, device, monkeypatch, force_kernel: bool, tol: float):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (4, 8), generator=g).to(device)
    sel = ["a", "b", None, "c"]
    with monkeypatch.context() as m:
        m.setattr(ops, "fused_multi_lora", lambda x: False)
        want, want_g = _run(model, lora, ids, sel)
    with monkeypatch.context() as m:
        if force_kernel:
            m.setattr(ops, "fused_multi_lora", lambda x: True)
            m.setattr(ops, "multi_lora", sgmv_lora)
        calls = []
        real = ops.multi_lora
        m.setattr(ops, "multi_lora", lambda *a: calls.append(1) or real(*a))
        got, got_g = _run(model, lora, ids, sel)
        with torch.inference_mode(), lora.use(sel):   # the engine's forwards: inference tensors (no version counter)
            got_inf = model(ids, use_cache=False).logits.float()
    assert calls, "the fused path was not taken"
    torch.testing.assert_close(got_inf, want, atol=tol, rtol=tol)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    for n in want_g:
        assert len(got_g[n]) == len(want_g[n]) and want_g[n], n
        for x, y in zip(got_g[n], want_g[n]):
            torch.testing.assert_close(x, y, atol=tol, rtol=tol, msg=n)


def test_cpu_default_is_the_torch_path():
    assert not ops.fused_multi_lora(torch.zeros(1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter counterpart of test_gpu_dispatch")
def test_kernel_path_matches_torch_path_interpreter(monkeypatch):
    model, lora = _model("cpu")
    _compare(model, lora, "cpu", monkeypatch, force_kernel=True, tol=2e-5)
    lora.close()


@pytest.mark.gpu
def test_gpu_dispatch_matches_torch_path(monkeypatch):
    model, lora = _model("cuda")
    assert ops.fused_multi_lora(torch.zeros(1, device="cuda"))
    _compare(model, lora, "cuda", monkeypatch, force_kernel=False, tol=1e-4)
    lora.close()
