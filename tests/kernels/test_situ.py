"""Fused SiTU (k3_kernels.situ.fused) against the reference; interpreter on CPU."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # (tests/conftest.py sets it too, before anything imports triton)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from k3_kernels.situ import naive_situ_and_mul  # noqa: E402
import k3_kernels.situ.fused as fz  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _close(a, b, atol_rel, rtol):
    """|a - b| <= rtol * |b| + atol_rel * max|b|."""
    a, b = a.double(), b.double()
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol_rel * b.abs().max().item())


def _check(M, I, dtype=torch.float32, scale=3.0, device=DEV, tol=2e-6):
    gu = (torch.randn(M, 2 * I, device=device) * scale).to(dtype).requires_grad_()
    g, u = gu.chunk(2, -1)  # strided halves of a fused projection, read in place
    dy = torch.randn(M, I, device=device).to(dtype)
    y = fz.situ_and_mul(g, u, 4.0, 25.0)
    y_ref = naive_situ_and_mul(g, u, 4.0, 25.0)
    assert y.dtype == y_ref.dtype
    # values range over orders of magnitude (|y| up to ~100): absolute floors relative to each tensor's largest value
    _close(y, y_ref, tol, tol)
    (a,), (b,) = torch.autograd.grad(y, [gu], dy), torch.autograd.grad(y_ref, [gu], dy)
    _close(a, b, tol, 10 * tol)


@pytest.mark.parametrize("scale", [0.01, 3.0, 60.0])
def test_matches_reference_fp32(scale):
    _check(5, 300, scale=scale)


def test_bf16_and_shapes():
    _check(3, 64, torch.bfloat16, tol=1e-2)
    g = torch.randn(2, 3, 4, 40, device=DEV)
    u = torch.randn(2, 3, 4, 40, device=DEV)
    torch.testing.assert_close(fz.situ_and_mul(g, u), naive_situ_and_mul(g, u), atol=1e-5, rtol=1e-5)


def test_bad_input():
    with pytest.raises(ValueError, match="up"):
        fz.situ_and_mul(torch.randn(3, 4, device=DEV), torch.randn(3, 5, device=DEV))


@pytest.mark.gpu
def test_gpu_matches_reference():
    _check(1000, 3072)
    _check(1000, 3072, torch.bfloat16, tol=1e-2)
