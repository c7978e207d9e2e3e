"""Codec: bit-exact round trips for every dtype, chunking, shuffling, levels; manifest contents."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from _helpers import chain, clone, make_state

from k3.sync import SyncError, WeightReceiver, encode_delta, encode_full, states_equal
from k3.sync.codec import _Source, host_bytes, read_manifest, shuffle_into, unshuffle_into


@pytest.mark.parametrize("chunk_bytes", [16, 64, 4096, 4 << 20])
@pytest.mark.parametrize("shuffle,sparse", [(True, True), (False, True), (True, False), (False, False)])
def test_delta_roundtrip_bit_exact(chunk_bytes, shuffle, sparse):
    base, new = chain(2)
    for k in list(new)[:3]:  # a few tensors with sparse changes, the rest dense
        new[k] = base[k].clone()
        new[k].view(torch.uint8)[::37] ^= 4
    payload = encode_delta(base, new, 0, 1, chunk_bytes=chunk_bytes, shuffle=shuffle, sparse=sparse)
    r = WeightReceiver(clone(base), 0)
    assert r.apply(payload) == 1 and r.version == 1
    assert states_equal(r.state_dict(), new)


def test_random_bit_patterns_nan_inf_negzero():
    """XOR works on bits: NaN payloads, infinities, -0.0 and subnormals survive exactly."""
    g = torch.Generator().manual_seed(3)
    base = {"a": torch.randint(-2**15, 2**15, (1001,), generator=g, dtype=torch.int16).view(torch.bfloat16),
            "b": torch.randint(-2**31, 2**31 - 1, (77,), generator=g, dtype=torch.int32).view(torch.float32),
            "c": torch.randint(0, 256, (99,), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)}
    new = {"a": torch.randint(-2**15, 2**15, (1001,), generator=g, dtype=torch.int16).view(torch.bfloat16),
           "b": torch.tensor([float("nan"), -0.0, float("inf"), 1e-45] * 19 + [0.0], dtype=torch.float32),
           "c": torch.randint(0, 256, (99,), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)}
    r = WeightReceiver(clone(base), 5)
    r.apply(encode_delta(base, new, 5, 6, chunk_bytes=48))
    assert states_equal(r.state_dict(), new)


@pytest.mark.parametrize("level", [-5, 1, 3, 9])
def test_full_snapshot_roundtrip_levels(level):
    s = make_state(7)
    payload = encode_full(s, 42, level=level, chunk_bytes=256)
    r = WeightReceiver.from_payload(payload)
    assert r.version == 42 and states_equal(r.state_dict(), s)
    # and applied onto an existing receiver of the same layout
    r2 = WeightReceiver(clone(make_state(1)), 3)
    r2.apply(payload)
    assert r2.version == 42 and states_equal(r2.state_dict(), s)


def test_receiver_updates_tensors_in_place():
    base, new = chain(2)
    live = clone(base)
    ptrs = {k: v.data_ptr() for k, v in live.items()}
    r = WeightReceiver(live, 0)
    r.apply(encode_delta(base, new, 0, 1))
    assert states_equal(live, new)
    assert {k: v.data_ptr() for k, v in r.state_dict().items()} == ptrs


def test_noncontiguous_inputs_encode():
    base = {"w": torch.randn(8, 6).to(torch.bfloat16).t()}
    new = {"w": (base["w"].float() + 1).to(torch.bfloat16)}
    r = WeightReceiver({"w": base["w"].contiguous()}, 0)
    r.apply(encode_delta(base, new, 0, 1))
    assert torch.equal(r.state_dict()["w"], new["w"])


def test_deterministic_bytes_and_thread_count_invariance():
    base, new = chain(2)
    a = encode_delta(base, new, 0, 1, chunk_bytes=64, threads=1)
    b = encode_delta(base, new, 0, 1, chunk_bytes=64, threads=4)
    assert a == b == encode_delta(base, new, 0, 1, chunk_bytes=64, threads=1)


def test_manifest_names_versions_tensors():
    base, new = chain(2)
    man = read_manifest(_Source(encode_delta(base, new, 0, 1, chain="run-a", chunk_bytes=64)))
    assert (man.kind, man.base_version, man.new_version, man.chain) == ("delta", 0, 1, "run-a")
    assert [e.name for e in man.tensors] == list(new)
    for e in man.tensors:
        assert e.dtype == new[e.name].dtype and e.shape == tuple(new[e.name].shape)
        assert e.frames == -(-e.nbytes // 64)
    assert man.total_bytes == sum(v.numel() * v.element_size() for v in new.values())


def test_unchanged_weights_compress_to_almost_nothing():
    s = {"w": torch.randn(512, 512).to(torch.bfloat16)}
    payload = encode_delta(s, clone(s), 0, 1)
    assert len(payload) < 0.01 * 512 * 512 * 2


def test_sparse_bf16_delta_is_small():
    """~1% of bf16 values change by one ulp: the payload is a small fraction of the raw bytes."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(1 << 18, generator=g) * 0.02).to(torch.bfloat16)
    bits = w.view(torch.int16).clone()
    idx = torch.randperm(w.numel(), generator=g)[: w.numel() // 100]
    bits[idx] += 1
    payload = encode_delta({"w": w}, {"w": bits.view(torch.bfloat16)}, 0, 1)
    assert len(payload) < 0.02 * w.numel() * 2


def test_shuffle_is_a_permutation():
    raw = np.arange(96, dtype=np.uint8)
    for width in (2, 4, 8):
        planes = shuffle_into(raw, width, np.empty_like(raw))
        assert np.array_equal(planes[: 96 // width], raw[::width])
        assert np.array_equal(unshuffle_into(planes, width, np.empty_like(raw)), raw)


def test_encode_rejects_bad_inputs():
    base, new = chain(2)
    with pytest.raises(SyncError, match="new_version 1 must be greater"):
        encode_delta(base, new, 1, 1)
    bad = dict(new)
    bad["layers.0.w"] = bad["layers.0.w"].float()
    with pytest.raises(SyncError, match="layers.0.w"):
        encode_delta(base, bad, 0, 1)
    with pytest.raises(SyncError, match="only in base \\['ids'\\]"):
        encode_delta(base, {k: v for k, v in new.items() if k != "ids"}, 0, 1)
    with pytest.raises(SyncError, match="chunk_bytes"):
        encode_full(new, 0, chunk_bytes=100)


def test_host_bytes_is_a_view():
    t = torch.zeros(4, dtype=torch.bfloat16)
    host_bytes(t)[:] = 0xFF
    assert t.view(torch.int16).eq(-1).all()


def test_many_versions_chain():
    states = chain(6)
    r = WeightReceiver(clone(states[0]), 0)
    for v in range(1, 6):
        r.apply(encode_delta(states[v - 1], states[v], v - 1, v, chunk_bytes=128))
        assert states_equal(r.state_dict(), states[v])


def _frame_flags(payload: bytes) -> list[bool]:
    from k3.sync.codec import iter_frame_records

    src = _Source(payload)
    return [rec.sparse for rec in iter_frame_records(src, read_manifest(src))]


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bool, torch.bfloat16, torch.float16, torch.float32,
                                   torch.float64, torch.int64, torch.float8_e4m3fn])
@pytest.mark.parametrize("density", [0.0, 0.0005, 0.05, 0.12, 0.6])
def test_sparse_and_dense_frames_bit_exact(dtype, density):
    """Sparse frames (gap-coded, incl. gaps >= 255) below the density threshold, dense above; both exact."""
    g = torch.Generator().manual_seed(int(density * 1e4))
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = 20000
    base_b = torch.randint(0, 256, (n * itemsize,), generator=g, dtype=torch.uint8)
    new_b = base_b.clone().view(n, itemsize)
    flip = torch.rand(n, generator=g) < density
    new_b[flip, 0] ^= torch.randint(1, 256, (int(flip.sum()),), generator=g, dtype=torch.uint8)
    base, new = base_b.view(dtype), new_b.reshape(-1).view(dtype)
    if dtype == torch.bool:  # keep valid bools: 0/1 bytes
        base, new = (base_b & 1).view(torch.bool), (new_b.reshape(-1) & 1).view(torch.bool)
    payload = encode_delta({"x": base}, {"x": new}, 0, 1, chunk_bytes=4096)
    sparse = _frame_flags(payload)
    changed = (base.view(torch.uint8).view(n, itemsize) != new.view(torch.uint8).view(n, itemsize)).any(1)
    assert all(sparse) == (changed.float().mean().item() < 0.25) and (any(sparse) == all(sparse))
    r = WeightReceiver({"x": base.clone()}, 0)
    r.apply(payload)
    assert torch.equal(r.state_dict()["x"].view(torch.uint8), new.view(torch.uint8))


def test_sparse_unpack_refuses_inconsistent_frames():
    from k3.sync.codec import pack_sparse, unpack_sparse
    from k3.sync.format import CorruptPayloadError

    xor = np.zeros(4000, dtype=np.uint8)
    xor[[3, 900, 3999]] = 1
    sp = pack_sparse(xor, 2, 2)
    idx, vals = unpack_sparse(sp, 2, 2, 2000, "t")
    out = np.zeros_like(xor)
    out.view(np.uint16)[idx] ^= vals
    assert np.array_equal(out, xor)
    with pytest.raises(CorruptPayloadError, match="length does not match"):
        unpack_sparse(sp[:-1], 2, 2, 2000, "t")
    with pytest.raises(CorruptPayloadError, match="beyond the chunk"):
        unpack_sparse(sp, 2, 2, 500, "t")

