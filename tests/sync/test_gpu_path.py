"""Triton XOR kernel (CPU interpreter mode here; GPU when CUDA is present) and the CUDA codec path: CUDA-encoded
payloads equal CPU-encoded ones; the CUDA receiver refuses truncated, bit-flipped and wrong-base payloads with
its live tensors untouched (its code also runs on CPU tensors: the non-gpu counterparts below)."""
from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _helpers import bitwise_equal, chain, clone, frame_offsets, with_flipped_bit

from k3.sync import CorruptPayloadError, WeightReceiver, encode_delta, encode_full, states_equal
from k3.sync.codec import _Source, read_manifest
from k3.sync.gpu import cuda_apply

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
    assert p_gpu == encode_delta(base, new, 0, 1, chunk_bytes=64)  # new bytes' hashes recorded, as on CPU
    assert encode_full(gn, 1, chunk_bytes=64) == encode_full(new, 1, chunk_bytes=64)
    r = WeightReceiver(clone(base), 0)  # CPU receiver decodes a GPU-encoded payload
    r.apply(p_gpu)
    assert states_equal(r.state_dict(), new)
    rg = WeightReceiver({k: v.clone() for k, v in gb.items()}, 0)  # CUDA receiver
    rg.apply(encode_delta(base, new, 0, 1, chunk_bytes=64))
    assert states_equal(rg.state_dict(), new)
    rg2 = WeightReceiver({k: v.clone() for k, v in gn.items()}, 9)
    rg2.apply(encode_full(gb, 10))
    assert states_equal(rg2.state_dict(), base)


# ------------------------------------------------------------------ refused payloads leave the weights untouched
# The same cases for three receivers: the CPU one, the CUDA receiver's code on CPU tensors, the CUDA one (gpu).
# The receiver holds version 1 (chain "c") and every payload claims to take version 1 to version 2.
REFUSED = ["truncated_70pct", "truncated_stream", "truncated_last_byte", "flipped_first_frame",
           "flipped_last_frame", "wrong_base_first_frame", "wrong_base_last_frame"]


def _payload(base, new, device: str) -> bytes:
    """encode_delta of `base` -> `new` (versions 1 -> 2, chain "c", 64-byte chunks) by the sender on `device`."""
    on = lambda s: {k: v.to(device) for k, v in s.items()}  # noqa: E731
    return encode_delta(on(base), on(new), 1, 2, chain="c", chunk_bytes=64)


def _refused(case: str, states, device: str = "cpu"):
    """(payload, what the CorruptPayloadError says) for a refused payload; `device`: where the sender encodes."""
    good = _payload(states[1], states[2], device)
    if case.startswith("truncated"):
        cut = {"truncated_70pct": good[:int(len(good) * 0.7)], "truncated_stream": good[:int(len(good) * 0.4)],
               "truncated_last_byte": good[:-1]}[case]
        return (io.BytesIO(cut) if case == "truncated_stream" else cut), "truncated"
    if case.startswith("flipped"):  # one bit of one frame's compressed data
        name, _, data = frame_offsets(good)[0 if case == "flipped_first_frame" else -1]
        bad = bytearray(good)
        bad[data] ^= 0x10
        return bytes(bad), f"tensor '{name}' frame \\d+: frame checksum mismatch"
    # wrong base, same version numbers: made against a base one bit off the receiver's; every frame is intact
    # and decodes, only the reconstruction is wrong (the first frame of the first tensor, or the last frame)
    name, byte = {"wrong_base_first_frame": ("embed.weight", 0), "wrong_base_last_frame": ("scalar", -1)}[case]
    assert frame_offsets(good)[-1][0] == "scalar"  # the last frame (the only one of "scalar")
    return (_payload(with_flipped_bit(states[1], name, byte), states[2], device),
            f"tensor '{name}' frame 0: reconstructed-weights checksum mismatch")


def _device_path_apply(state, payload, threads: int = 2) -> None:
    """The CUDA receiver's apply (k3.sync.gpu.cuda_apply) on `state` in place; CPU tensors run it without streams."""
    src = _Source(payload)
    cuda_apply(state, src, read_manifest(src), threads)


@pytest.mark.parametrize("case", REFUSED)
def test_cpu_receiver_refuses_bad_payload_untouched(case):
    states = chain(3)
    live = clone(states[1])
    r = WeightReceiver(live, 1, chain="c", threads=2)
    payload, match = _refused(case, states)
    with pytest.raises(CorruptPayloadError, match=match):
        r.apply(payload)
    assert r.version == 1 and bitwise_equal(live, states[1])
    assert r.apply(_payload(states[1], states[2], "cpu")) == 2 and bitwise_equal(live, states[2])


@pytest.mark.parametrize("case", REFUSED)
def test_device_path_on_cpu_refuses_bad_payload_untouched(case):
    states = chain(3)
    live = clone(states[1])
    payload, match = _refused(case, states)
    with pytest.raises(CorruptPayloadError, match=match):
        _device_path_apply(live, payload)
    assert bitwise_equal(live, states[1])
    _device_path_apply(live, _payload(states[1], states[2], "cpu"))
    assert bitwise_equal(live, states[2])


def test_device_path_on_cpu_applies_delta_and_full():
    states = chain(3)
    live = clone(states[1])
    _device_path_apply(live, _payload(states[1], states[2], "cpu"))
    assert bitwise_equal(live, states[2])
    _device_path_apply(live, encode_full(states[0], 0, chunk_bytes=64))
    assert bitwise_equal(live, states[0])


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("encoder", ["cpu", "cuda"])
@pytest.mark.parametrize("case", REFUSED)
def test_cuda_receiver_refuses_bad_payload_untouched(case, encoder):
    """Every live CUDA tensor stays bitwise untouched, the version too, and the correct payload applies after."""
    states = chain(3)
    live = {k: v.cuda() for k, v in states[1].items()}
    before = {k: v.clone() for k, v in live.items()}
    r = WeightReceiver(live, 1, chain="c", threads=4)
    payload, match = _refused(case, states, encoder)
    with pytest.raises(CorruptPayloadError, match=match):
        r.apply(payload)
    assert r.version == 1
    assert all(t.is_cuda for t in live.values()) and bitwise_equal(live, before)
    assert r.apply(_payload(states[1], states[2], encoder)) == 2
    assert bitwise_equal(live, {k: v.cuda() for k, v in states[2].items()})
