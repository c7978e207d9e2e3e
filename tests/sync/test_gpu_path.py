"""Triton XOR kernel (CPU interpreter mode here; GPU when CUDA is present) and the CUDA codec path."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _helpers import chain, clone

from k3.sync import WeightReceiver, encode_delta, encode_full, states_equal

ROOT = Path(__file__).parents[2]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

_INTERPRET_SCRIPT = r"""
import torch
from k3_kernels.xor import naive_xor_bytes, xor_bytes
g = torch.Generator().manual_seed(0)
cases = [(torch.bfloat16, 1000), (torch.float32, 33), (torch.uint8, 7), (torch.float8_e4m3fn, 9),
         (torch.int16, 5), (torch.float64, 3), (torch.bfloat16, 4099)]
for dtype, n in cases:
    a = torch.randint(0, 256, (n * torch.empty((), dtype=dtype).element_size(),), generator=g, dtype=torch.uint8)
    b = torch.randint(0, 256, a.shape, generator=g, dtype=torch.uint8)
    a, b = a.view(dtype), b.view(dtype)
    assert torch.equal(xor_bytes(a, b, block=256), naive_xor_bytes(a, b)), dtype
# misaligned slices fall back to byte words and stay exact
a = torch.randint(0, 256, (1001,), generator=g, dtype=torch.uint8)
b = torch.randint(0, 256, (1001,), generator=g, dtype=torch.uint8)
assert torch.equal(xor_bytes(a[1:], b[:-1], block=128), torch.bitwise_xor(a[1:], b[:-1]))
print("ok")
"""


def test_triton_xor_interpreter_matches_reference():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "_k3k"), env.get("PYTHONPATH", "")])
    pytest.importorskip("triton")
    res = subprocess.run([sys.executable, "-c", _INTERPRET_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


@pytest.mark.gpu
@cuda
def test_triton_xor_gpu_matches_reference():
    from k3_kernels.xor import naive_xor_bytes, xor_bytes

    for dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.uint8):
        a = torch.randint(0, 256, (3 * 2**20 + 5,), dtype=torch.uint8, device="cuda")
        b = torch.randint(0, 256, a.shape, dtype=torch.uint8, device="cuda")
        n = a.numel() // torch.empty((), dtype=dtype).element_size() * torch.empty((), dtype=dtype).element_size()
        a, b = a[:n].view(dtype), b[:n].view(dtype)
        assert torch.equal(xor_bytes(a, b), naive_xor_bytes(a, b))


@pytest.mark.gpu
@cuda
def test_cuda_encode_equals_cpu_encode_and_cuda_receiver():
    base, new = chain(2)
    gb = {k: v.cuda() for k, v in base.items()}
    gn = {k: v.cuda() for k, v in new.items()}
    p_gpu = encode_delta(gb, gn, 0, 1, chunk_bytes=64)
    r = WeightReceiver(clone(base), 0)  # CPU receiver decodes a GPU-encoded payload
    r.apply(p_gpu)
    assert states_equal(r.state_dict(), new)
    rg = WeightReceiver({k: v.clone() for k, v in gb.items()}, 0)  # CUDA receiver
    rg.apply(encode_delta(base, new, 0, 1, chunk_bytes=64))
    assert states_equal(rg.state_dict(), new)
    rg2 = WeightReceiver({k: v.clone() for k, v in gn.items()}, 9)
    rg2.apply(encode_full(gb, 10))
    assert states_equal(rg2.state_dict(), base)
