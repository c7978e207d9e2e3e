"""Batch-invariant RMSNorm / gated RMSNorm (k3_kernels.norm.fused) against the references; interpreter on CPU."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # (tests/conftest.py sets it too, before anything imports triton)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from k3_kernels.norm import naive_gated_rms_norm, naive_rms_norm  # noqa: E402
import k3_kernels.norm.fused as fz  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _check(gated, D, has_w, dtype=torch.float32, shape=(3, 5), device=DEV, tol=1e-5):
    x = torch.randn(*shape, D, device=device).mul(3).to(dtype).requires_grad_()
    gate = torch.randn(*shape, D, device=device).to(dtype).requires_grad_() if gated else None
    w = (1 + 0.1 * torch.randn(D, device=device)).requires_grad_() if has_w else None
    dy = torch.randn(*shape, D, device=device).to(dtype)
    args = (x, gate, w) if gated else (x, w)
    y = (fz.gated_rms_norm if gated else fz.rms_norm)(*args, 1e-6)
    y_ref = (naive_gated_rms_norm if gated else naive_rms_norm)(*args, 1e-6)
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    torch.testing.assert_close(y.float(), y_ref.float(), atol=tol, rtol=tol)
    ins = [t for t in args if t is not None]
    for a, b in zip(torch.autograd.grad(y, ins, dy), torch.autograd.grad(y_ref, ins, dy)):
        torch.testing.assert_close(a.float(), b.float(), atol=10 * tol, rtol=10 * tol)


@pytest.mark.parametrize("D", [48, 128, 300])
@pytest.mark.parametrize("has_w", [True, False])
@pytest.mark.parametrize("gated", [False, True])
def test_matches_reference_fp32(gated, D, has_w):
    _check(gated, D, has_w)


def test_bf16_and_strided_input():
    _check(False, 64, True, torch.bfloat16, tol=1e-2)
    _check(True, 64, True, torch.bfloat16, tol=1e-2)
    base = torch.randn(7, 2 * 40, device=DEV, requires_grad=True)
    x = base[:, 40:]  # row stride 80: read in place
    w = torch.rand(40, device=DEV) + 0.5
    torch.testing.assert_close(fz.rms_norm(x, w), naive_rms_norm(x, w), atol=1e-5, rtol=1e-5)


def _batch_invariance(D, dtype, device, sizes):
    big = max(sizes) + 3
    x = torch.randn(big, D, device=device).to(dtype)
    gate = torch.randn(big, D, device=device).to(dtype)
    w = 1 + 0.1 * torch.randn(D, device=device)
    dy = torch.randn(big, D, device=device).to(dtype)
    for gated in (False, True):
        def run(sl):
            xs = x[sl].clone().requires_grad_()
            gs = gate[sl].clone().requires_grad_()
            y = fz.gated_rms_norm(xs, gs, w) if gated else fz.rms_norm(xs, w)
            y.backward(dy[sl])
            return y.detach(), xs.grad, gs.grad
        alone = [run(slice(j, j + 1)) for j in range(big)]
        for n in sizes:
            for start in (0, 1, big - n):
                y, dx, dg = run(slice(start, start + n))
                for j in range(n):
                    a = alone[start + j]
                    assert torch.equal(y[j], a[0][0]) and torch.equal(dx[j], a[1][0]), (gated, n, start, j)
                    if gated:
                        assert torch.equal(dg[j], a[2][0])


def test_batch_invariance_bits():
    _batch_invariance(48, torch.float32, DEV, [2, 5, 19])


def test_weight_grad_deterministic():
    x = torch.randn(37, 64, device=DEV, requires_grad=True)
    w = torch.rand(64, device=DEV, requires_grad=True)
    dy = torch.randn(37, 64, device=DEV)
    g1 = torch.autograd.grad(fz.rms_norm(x, w), [w], dy)[0]
    g2 = torch.autograd.grad(fz.rms_norm(x, w), [w], dy)[0]
    assert torch.equal(g1, g2)


def test_bad_input_names_the_tensor():
    x = torch.randn(4, 16, device=DEV)
    with pytest.raises(ValueError, match="weight"):
        fz.rms_norm(x, torch.ones(8, device=DEV))
    with pytest.raises(ValueError, match="gate"):
        fz.gated_rms_norm(x, torch.randn(4, 8, device=DEV), None)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [128, 7168])
def test_gpu_matches_reference(D):
    _check(False, D, True, shape=(300,))
    _check(True, D, True, shape=(300,))
    _check(False, D, True, torch.bfloat16, shape=(300,), tol=1e-2)


@pytest.mark.gpu
def test_gpu_batch_invariance_bits():
    _batch_invariance(7168, torch.bfloat16, "cuda", [2, 7, 130])
    _batch_invariance(128, torch.bfloat16, "cuda", [3, 17, 1000])
