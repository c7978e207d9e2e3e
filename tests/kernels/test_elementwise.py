"""k3_kernels.elementwise.position_invariant: an element's bits do not depend on its tensor's size or its offset
there, on every CPU ISA ATen dispatches to. Why it exists: CI's CPU (AVX2) put KDA's beta sigmoid of a packed
sequence in the scalar tail and the same sequence alone in the SIMD body, and the batch-invariance test failed
there while it passed on AVX-512 machines."""
import os
import subprocess
import sys

import pytest
import torch

from k3_kernels.elementwise import PIECE, position_invariant

FUNCS = {"sigmoid": torch.sigmoid, "exp": torch.exp, "logsigmoid": torch.nn.functional.logsigmoid,
         "softplus": torch.nn.functional.softplus, "silu": torch.nn.functional.silu}

_CHECK = """
import torch
from k3_kernels.elementwise import position_invariant
fns = [torch.sigmoid, torch.exp, torch.nn.functional.logsigmoid, torch.nn.functional.softplus,
       torch.nn.functional.silu]
g = torch.Generator().manual_seed(0)
bad = 0
for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(3 * {piece} + 77, generator=g).to(dtype)
    for fn in fns:
        full = position_invariant(fn, x)
        for start, stop in ((30, 110), (1, 17), (5, {piece} + 9), ({piece} - 3, 3 * {piece} + 70)):
            bad += int((position_invariant(fn, x[start:stop].clone()) != full[start:stop]).sum())
print(torch.backends.cpu.get_cpu_capability(), bad)
"""


@pytest.mark.parametrize("name", sorted(FUNCS))
def test_packed_slice_equals_alone_and_matches_fn(name):
    """Slices of a packed call equal the same values alone (sizes around and across the piece length), forward and
    backward, and the values are fn's (to rounding)."""
    fn = FUNCS[name]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * PIECE + 301, generator=g, requires_grad=True)
    full = position_invariant(fn, x)
    torch.testing.assert_close(full, fn(x))
    (dfull,) = torch.autograd.grad(full, x, torch.ones_like(full))
    for start, stop in ((30, 110), (0, 1), (7, PIECE + 5), (PIECE - 1, 2 * PIECE + 300)):
        alone = x.detach()[start:stop].clone().requires_grad_(True)
        y = position_invariant(fn, alone)
        assert torch.equal(y, full[start:stop]), (name, start, stop)
        (dy,) = torch.autograd.grad(y, alone, torch.ones_like(y))
        assert torch.equal(dy, dfull[start:stop]), (name, start, stop)


def test_shapes_and_empty():
    """Any shape comes back in its shape; an empty tensor is fn's own result."""
    x = torch.randn(3, 5, 7)
    assert position_invariant(torch.sigmoid, x).shape == x.shape
    assert position_invariant(torch.sigmoid, torch.empty(0, 4)).shape == (0, 4)


@pytest.mark.parametrize("isa", ["avx2", "default"])
def test_other_isas(isa):
    """The same property with ATen forced to another ISA (CI's machines and ours dispatch differently)."""
    env = dict(os.environ, ATEN_CPU_CAPABILITY=isa)
    out = subprocess.run([sys.executable, "-c", _CHECK.format(piece=PIECE)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "0", out.stdout
