"""Batch-invariant RMSNorm / gated RMSNorm (k3_kernels.norm.fused) against the references; interpreter on CPU."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # (tests/conftest.py sets it too, before anything imports triton)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from k3_kernels.norm import naive_gated_rms_norm, naive_rms_norm  # noqa: E402
import k3_kernels.norm.fused as fz  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _close(a, b, tol):
    """Elementwise |a - b| <= tol * (|b| + RMS(b)): relative to each element and to the tensor's own scale
    (an absolute floor that does not depend on how large the values happen to be)."""
    a, b = a.double(), b.double()
    torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.square().mean().sqrt().item())


def _check(gated, D, has_w, dtype=torch.float32, shape=(3, 5), device=DEV, tol=1e-5):
    x = torch.randn(*shape, D, device=device).mul(3).to(dtype).requires_grad_()
    gate = torch.randn(*shape, D, device=device).to(dtype).requires_grad_() if gated else None
    w = (1 + 0.1 * torch.randn(D, device=device)).requires_grad_() if has_w else None
    dy = torch.randn(*shape, D, device=device).to(dtype)
    args = (x, gate, w) if gated else (x, w)
    y = (fz.gated_rms_norm if gated else fz.rms_norm)(*args, 1e-6)
    y_ref = (naive_gated_rms_norm if gated else naive_rms_norm)(*args, 1e-6)
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    _close(y, y_ref, tol)
    ins = [t for t in args if t is not None]
    for a, b in zip(torch.autograd.grad(y, ins, dy), torch.autograd.grad(y_ref, ins, dy)):
        _close(a, b, 10 * tol)


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
    _close(fz.rms_norm(x, w), naive_rms_norm(x, w), 1e-5)
    dy = torch.randn(7, 40, device=DEV)
    (g,), (g_ref,) = torch.autograd.grad(fz.rms_norm(x, w), [base], dy), torch.autograd.grad(naive_rms_norm(x, w),
                                                                                               [base], dy)
    _close(g, g_ref, 1e-4)


def test_no_grad_path_matches_autograd_path_bits():
    """Without autograd the wrapper is skipped (and rstd is not stored): same output bits."""
    x = torch.randn(2, 3, 64, device=DEV, requires_grad=True)
    gate = torch.randn(2, 3, 64, device=DEV)
    w = torch.rand(64, device=DEV) + 0.5
    for f, args in ((fz.rms_norm, (w,)), (fz.gated_rms_norm, (gate, w))):
        y = f(x, *args)
        assert y.requires_grad and y.shape == x.shape
        with torch.no_grad():
            y0 = f(x, *args)
        assert not y0.requires_grad and torch.equal(y0, y.detach())


def test_second_derivative_is_refused():
    x = torch.randn(4, 32, device=DEV, requires_grad=True)
    w = torch.rand(32, device=DEV, requires_grad=True)
    (gx,) = torch.autograd.grad(fz.rms_norm(x, w).square().sum(), [x], create_graph=True)
    with pytest.raises(RuntimeError):
        gx.sum().backward()


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
    with pytest.raises(ValueError, match="gate"):
        fz.gated_rms_norm(x, None, None)


def test_node_key_equal_implies_triton_specialisation_equal():
    """The C++ node's direct-launch cache reuses a compiled kernel for every launch with the same key: two argument
    values with one key must get one specialisation from Triton's own specialiser (CUDA backend, run on CPU)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    key = fz._node().specialisation_key
    buf = torch.empty(64, dtype=torch.float32)
    values = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2**31 - 16, 2**31, 2**31 + 16, 2**62, 2**63 - 16, -2**31,
              -2**31 - 16, -2**63, 0.5, 3.0, None, buf, buf[1:], buf[2:], buf[4:], buf[8:], buf.half(),
              buf.half()[8:], buf.bfloat16()[3:], torch.empty(0)]
    keys = [key([v]) for v in values]
    assert len(set(keys)) == 10  # ints: == 1, % 16 at 32 and at 64 bits, other; float; None; 4 tensor kinds
    for a, ka in zip(values, keys):
        for b, kb in zip(values, keys):
            if ka == kb:
                sa = native_specialize_impl(backend, a, False, True, True)
                sb = native_specialize_impl(backend, b, False, True, True)
                assert sa == sb, (a, b, sa, sb)


@pytest.mark.gpu
def test_gpu_node_launches_directly_after_first_call():
    """After one forward+backward per specialisation, the node launches from its cache (no new entries on the
    second call) and gives the same bits as the first call."""
    node = fz._node()
    x = torch.randn(64, 7168, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(7168, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    first = torch.autograd.grad(fz.rms_norm(x, w), [x, w], dy)
    cached = node.cached_kernels()
    assert cached >= 3  # forward, backward, weight-gradient column sum
    second = torch.autograd.grad(fz.rms_norm(x, w), [x, w], dy)
    assert node.cached_kernels() == cached
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.gpu
@pytest.mark.parametrize("D", [128, 7168])
def test_gpu_matches_reference(D):
    _check(False, D, True, shape=(300,))
    _check(True, D, True, shape=(300,))
    _check(False, D, True, torch.bfloat16, shape=(300,), tol=1e-2)


@pytest.mark.gpu
def test_gpu_weight_grad_deterministic_k3_width():
    """K3's width and a 4K-row batch (the persistent backward's partials over every program): bitwise reruns."""
    x = torch.randn(4096, 7168, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x, requires_grad=True)
    w = (1 + 0.1 * torch.randn(7168, device="cuda")).to(torch.bfloat16).requires_grad_()
    dy = torch.randn_like(x)
    for f, ins in ((lambda: fz.rms_norm(x, w), [x, w]), (lambda: fz.gated_rms_norm(x, g, w), [x, g, w])):
        g1 = torch.autograd.grad(f(), ins, dy)
        g2 = torch.autograd.grad(f(), ins, dy)
        assert all(torch.equal(a, b) for a, b in zip(g1, g2))
        w_ref = torch.autograd.grad(naive_rms_norm(x, w) if len(ins) == 2 else naive_gated_rms_norm(x, g, w),
                                    [w], dy)[0]
        _close(g1[-1], w_ref, 1e-2)


@pytest.mark.gpu
def test_gpu_batch_invariance_bits():
    _batch_invariance(7168, torch.bfloat16, "cuda", [2, 7, 130])
    _batch_invariance(128, torch.bfloat16, "cuda", [3, 17, 1000])
