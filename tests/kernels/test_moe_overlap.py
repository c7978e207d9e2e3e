"""The shared experts beside the routed ones (k3_kernels.moe.overlap): a side stream changes when kernels run, never
what they compute.

Why: the MoE layer runs its shared MLP on a side CUDA stream so its GEMMs overlap the routed path's memory-bound
kernels; a missing wait (the caller reading the shared output, or a gradient, before the side stream wrote it) or
an allocation reused while the other stream still reads it would give wrong numbers only on the GPU and only
sometimes. The `gpu` tests compare the overlapped layer's output and every gradient with the serial order's, bit for
bit, over repeated steps; on CPU (no streams) the overlap runs inline, which the CPU tests pin."""
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # (tests/conftest.py sets it too, before anything imports triton)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from _moe_interp import DEV, experts_case  # noqa: E402
from k3_kernels.moe.layer import Precision, clear_fp8_cache, moe_experts  # noqa: E402
from k3_kernels.moe.overlap import SERIAL, StreamOverlap, start_beside  # noqa: E402
from k3_kernels.situ import naive_situ_and_mul  # noqa: E402

BETA, LINEAR_BETA = 1.0, 0.1


def _situ(g, u):
    if g.is_cuda:
        from k3_kernels.situ.fused import situ_and_mul
        return situ_and_mul(g, u, BETA, LINEAR_BETA)
    return naive_situ_and_mul(g, u, BETA, LINEAR_BETA)


def _layer_step(overlap, N, L, I, E, k, S, precision, seed=0):
    """One forward+backward of routed experts + a shared SiTU MLP of width S beside them -> (y, grads)."""
    z, ids, w, w1, w3, w2 = experts_case(N, L, I, E, k, dtype=torch.bfloat16, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    shared = [(torch.randn(*s, generator=g) / s[1] ** 0.5).to(DEV, torch.bfloat16) for s in ((S, L), (S, L), (L, S))]
    leaves = [z, w1, w3, w2, *shared]
    for t in leaves:
        t.requires_grad_(True)
    sg, su, sd = shared

    def shared_mlp(x):
        return F.linear(_situ(F.linear(x, sg), F.linear(x, su)), sd)

    beside = start_beside(shared_mlp, z, overlap)
    y = moe_experts(z, ids, w, w1, w3, w2, BETA, LINEAR_BETA, precision, ids_checked=True) + beside.join()
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed + 2)).to(DEV, y.dtype)
    y.backward(dy)
    out = [y.detach()] + [t.grad for t in leaves]
    clear_fp8_cache()
    return out


def test_cpu_runs_inline():
    x = torch.randn(4, 8)
    for overlap in (StreamOverlap(), StreamOverlap(priority=-1), SERIAL):
        beside = start_beside(lambda t: t * 2, x, overlap)
        assert beside.stream is None
        assert torch.equal(beside.join(), x * 2)


def test_layer_same_bits_as_serial_on_any_device():
    """On CPU the overlap is inline; on a GPU this is the small case of the gpu test below."""
    serial = _layer_step(SERIAL, 64, 32, 32, 4, 2, 64, Precision.BF16)
    beside = _layer_step(StreamOverlap(), 64, 32, 32, 4, 2, 64, Precision.BF16)
    for a, b in zip(serial, beside):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", [Precision.BF16, Precision.FP8_FULL])
@pytest.mark.parametrize("priority", [0, -1])
def test_gpu_layer_same_bits_as_serial(precision, priority):
    """Large enough that the side stream's GEMMs are still running when the routed path reaches the add."""
    shapes = dict(N=4096, L=1024, I=512, E=16, k=4, S=2048, precision=precision)
    serial = _layer_step(SERIAL, **shapes)
    for step in range(3):
        beside = _layer_step(StreamOverlap(priority=priority), **shapes)
        for i, (a, b) in enumerate(zip(serial, beside)):
            assert torch.equal(a, b), f"step {step}: tensor {i} (0: y, 1: dz, 2-4: w1/w3/w2, 5-7: shared)"
