"""k3_kernels.launch: the cached launcher's compile key and its equivalence with Triton's own launch."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # (tests/conftest.py sets it too, before anything imports triton)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from k3_kernels.launch import CachedLaunch, _spec  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _axpy(x_ptr, y_ptr, out_ptr, a, n, stride, HAS_Y: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = a * tl.load(x_ptr + offs * stride, mask=mask)
    if HAS_Y:
        v += tl.load(y_ptr + offs * stride, mask=mask)
    tl.store(out_ptr + offs, v, mask=mask)


def test_spec_refines_triton_specialisation():
    """Every property Triton compiles in must change the key: alignment, dtype, int == 1, % 16, 64-bit range."""
    t = torch.empty(64, dtype=torch.bfloat16)
    assert _spec(t) != _spec(t[1:])  # 2-byte offset: not 16-byte aligned
    assert _spec(t) == _spec(t[8:])  # 16-byte offset: aligned
    assert _spec(t) != _spec(t.float())
    assert len({_spec(1), _spec(2), _spec(16), _spec(2**31 + 16)}) == 4
    assert _spec(None) != _spec(False) and _spec(True) != _spec(1)


def test_spec_equal_implies_triton_specialisation_equal():
    """The property the cache relies on, checked against Triton's own specialiser (its CUDA backend runs on CPU):
    two arguments with one key must get one specialisation, so a cached kernel is never reused where Triton would
    have compiled another."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    buf = torch.empty(64, dtype=torch.float32)
    values = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2**31 - 16, 2**31, 2**31 + 16, 2**62, 2**63 - 16, 2**63, 2**63 + 16,
              2**64 - 16, -2**31, -2**31 - 16, -2**63, 0.5, 3.0, True, False, None, buf, buf[1:], buf[2:], buf[4:],
              buf[8:], buf.half(), buf.half()[8:], buf.bfloat16()[3:], torch.empty(0)]
    for a in values:
        for b in values:
            if type(a) is type(b) and _spec(a) == _spec(b):
                sa = native_specialize_impl(backend, a, False, True, True)
                sb = native_specialize_impl(backend, b, False, True, True)
                assert sa == sb, (a, b, sa, sb)


def _run(launch, x, y, n, stride):
    out = torch.zeros(n, device=x.device)
    launch((triton.cdiv(n, 32),), x, y, out, 2.0, n, stride, HAS_Y=y is not None, BLOCK=32, num_warps=1)
    return out


def test_matches_plain_launch_across_keys():
    """Each call, first or cached, aligned or not, with or without an operand, strided or not, matches the
    reference: a stale compiled kernel reused across a key change would read the wrong addresses or skip y."""
    launch = CachedLaunch(_axpy)
    base = torch.randn(301, device=DEV)
    other = torch.randn(301, device=DEV)
    for _ in range(2):  # the second round takes the cached path on CUDA
        for off, n, stride, with_y in ((0, 100, 1, True), (1, 100, 1, True), (0, 100, 1, False), (0, 1, 1, True),
                                       (0, 96, 1, True), (0, 100, 3, True), (3, 33, 2, False)):
            x, y = base[off:], other[off:] if with_y else None
            ref = 2.0 * x[::stride][:n] + (y[::stride][:n] if with_y else 0)
            assert torch.equal(_run(launch, x, y, n, stride), ref), (off, n, stride, with_y)


@pytest.mark.gpu
def test_gpu_cached_path_taken_and_keyed():
    launch = CachedLaunch(_axpy)
    x = torch.randn(300, device="cuda")
    _run(launch, x, None, 100, 1)
    _run(launch, x, None, 100, 1)
    assert len(launch._compiled) == 1
    _run(launch, x[1:], None, 100, 1)
    _run(launch, x, x, 100, 1)
    assert len(launch._compiled) == 3
