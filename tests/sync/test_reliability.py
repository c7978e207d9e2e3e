"""Receiver refuses bad payloads with an error naming the fault, and keeps its previous version intact."""
from __future__ import annotations

import io

import pytest
import torch
from _helpers import chain, clone, frame_offsets

from k3.sync import (CorruptPayloadError, ManifestMismatchError, SyncError, VersionError, WeightReceiver,
                     encode_delta, encode_full, states_equal)
from k3.sync.format import FRAME, MAGIC, TRAILER, U32


@pytest.fixture
def v012():
    return chain(3)


def _receiver(states, v=1):
    return WeightReceiver(clone(states[v]), v, chain="c")


def _assert_intact(r, states, v=1):
    assert r.version == v
    assert states_equal(r.state_dict(), states[v])


def test_wrong_base_version_refused(v012):
    r = _receiver(v012, 1)
    p = encode_delta(v012[0], v012[1], 0, 1, chain="c")
    with pytest.raises(VersionError, match="base_version 0 .* receiver's version 1"):
        r.apply(p)
    _assert_intact(r, v012)


def test_other_chain_same_version_refused(v012):
    r = _receiver(v012, 1)
    with pytest.raises(VersionError, match="chain 'other'"):
        r.apply(encode_delta(v012[1], v012[2], 1, 2, chain="other"))
    _assert_intact(r, v012)


def test_stale_full_snapshot_refused(v012):
    r = _receiver(v012, 1)
    with pytest.raises(VersionError, match="older"):
        r.apply(encode_full(v012[0], 0, chain="c"))
    _assert_intact(r, v012)


@pytest.mark.parametrize("where", ["data_first", "data_last", "frame_header", "frame_checksum"])
def test_flipped_byte_in_frame_refused_naming_tensor(v012, where):
    p = bytearray(encode_delta(v012[1], v012[2], 1, 2, chain="c", chunk_bytes=64))
    frames = frame_offsets(bytes(p))
    name, rec, data = frames[0] if where != "data_last" else frames[-1]
    pos = {"data_first": data, "data_last": data, "frame_header": rec + 30, "frame_checksum": rec + FRAME.size}[where]
    p[pos] ^= 0x10
    r = _receiver(v012, 1)
    with pytest.raises(CorruptPayloadError, match=f"tensor '{name}' frame"):
        r.apply(bytes(p))
    _assert_intact(r, v012)


def test_every_single_byte_flip_is_refused(v012):
    """Exhaustive: a flip anywhere (header, manifest, any frame, trailer) is refused; state intact."""
    p = encode_delta(v012[1], v012[2], 1, 2, chain="c", chunk_bytes=512)
    r = _receiver(v012, 1)
    step = max(1, len(p) // 400)
    for i in range(0, len(p), step):
        bad = bytearray(p)
        bad[i] ^= 0x01
        with pytest.raises(SyncError):
            r.apply(bytes(bad))
    _assert_intact(r, v012)
    assert r.apply(p) == 2 and states_equal(r.state_dict(), v012[2])


def test_manifest_and_trailer_flips(v012):
    p = encode_delta(v012[1], v012[2], 1, 2, chain="c")
    r = _receiver(v012, 1)
    for pos, msg in [(3, "bad magic"), (len(MAGIC) + U32.size + 5, "manifest checksum"),
                     (len(p) - TRAILER.size + 1, "trailer"), (len(p) - 3, "trailer")]:
        bad = bytearray(p)
        bad[pos] ^= 0x04
        with pytest.raises(CorruptPayloadError, match=msg):
            r.apply(bytes(bad))
    _assert_intact(r, v012)


@pytest.mark.parametrize("frac", [0.0, 0.001, 0.3, 0.7, 0.999])
def test_truncated_payload_refused(v012, frac):
    p = encode_delta(v012[1], v012[2], 1, 2, chain="c", chunk_bytes=64)
    cut = p[: int(len(p) * frac)]
    r = _receiver(v012, 1)
    with pytest.raises(CorruptPayloadError, match="truncated"):
        r.apply(cut)
    with pytest.raises(CorruptPayloadError, match="truncated"):
        r.apply(io.BytesIO(cut))  # stream that ends early (a dropped connection)
    _assert_intact(r, v012)


def test_trailing_garbage_refused(v012):
    r = _receiver(v012, 1)
    with pytest.raises(CorruptPayloadError, match="trailing bytes"):
        r.apply(encode_delta(v012[1], v012[2], 1, 2, chain="c") + b"x")
    _assert_intact(r, v012)


def test_shape_mismatch_refused(v012):
    r = _receiver(v012, 1)
    b, n = clone(v012[1]), clone(v012[2])
    b["layers.0.w"], n["layers.0.w"] = b["layers.0.w"].reshape(7, 300), n["layers.0.w"].reshape(7, 300)
    with pytest.raises(ManifestMismatchError, match=r"tensor 'layers.0.w': payload shape \[7, 300\]"):
        r.apply(encode_delta(b, n, 1, 2))
    _assert_intact(r, v012)


def test_dtype_mismatch_refused(v012):
    r = _receiver(v012, 1)
    b, n = clone(v012[1]), clone(v012[2])
    b["layers.0.norm"], n["layers.0.norm"] = b["layers.0.norm"].half(), n["layers.0.norm"].half()
    with pytest.raises(ManifestMismatchError, match="tensor 'layers.0.norm': payload dtype float16 != receiver"):
        r.apply(encode_delta(b, n, 1, 2))
    _assert_intact(r, v012)


def test_missing_and_unknown_tensor_refused(v012):
    r = _receiver(v012, 1)
    b = {k: v for k, v in v012[1].items() if k != "ids"}
    n = {k: v for k, v in v012[2].items() if k != "ids"}
    with pytest.raises(ManifestMismatchError, match=r"missing tensor\(s\) \['ids'\]"):
        r.apply(encode_delta(b, n, 1, 2))
    with pytest.raises(ManifestMismatchError, match=r"missing tensor\(s\) \['ids'\]"):
        r.apply(encode_full(n, 2))
    extra_b, extra_n = {**v012[1], "new.w": torch.zeros(3)}, {**v012[2], "new.w": torch.ones(3)}
    with pytest.raises(ManifestMismatchError, match=r"unknown to the receiver \['new.w'\]"):
        r.apply(encode_delta(extra_b, extra_n, 1, 2))
    _assert_intact(r, v012)


def test_base_bytes_differ_detected_by_new_checksum(v012):
    """Same version number, different base bytes (e.g. a receiver restored from the wrong file): the
    reconstructed weights fail their checksum instead of silently diverging."""
    wrong = clone(v012[1])
    wrong["embed.weight"].view(torch.int16)[0] ^= 1
    r = WeightReceiver(clone(wrong), 1)
    with pytest.raises(CorruptPayloadError, match="tensor 'embed.weight' frame 0: reconstructed-weights"):
        r.apply(encode_delta(v012[1], v012[2], 1, 2))
    assert states_equal(r.state_dict(), wrong)


def test_forged_manifest_fields_refused(v012):
    """A well-checksummed manifest that is internally inconsistent is refused naming the field."""
    import json

    from k3.sync.format import pack_header, unpack_manifest_json

    p = encode_delta(v012[1], v012[2], 1, 2)
    n = U32.unpack(p[len(MAGIC):len(MAGIC) + 4])[0]
    meta = json.loads(unpack_manifest_json(p[len(MAGIC) + 4:len(MAGIC) + 4 + n]))
    meta["tensors"][1]["nbytes"] += 2
    forged, _ = pack_header(meta)
    r = _receiver(v012, 1)
    with pytest.raises(CorruptPayloadError, match="tensor 'layers.0.w': manifest nbytes"):
        r.apply(forged + p[len(MAGIC) + 4 + n + 8:])
    _assert_intact(r, v012)


def test_receiver_recovers_after_refusals(v012):
    r = _receiver(v012, 1)
    good = encode_delta(v012[1], v012[2], 1, 2, chain="c")
    for bad in (good[:100], good[:-1], b"", b"junk" * 10):
        with pytest.raises(SyncError):
            r.apply(bad)
    assert r.apply(good) == 2 and states_equal(r.state_dict(), v012[2])


def test_not_a_payload_type():
    r = WeightReceiver({"a": torch.zeros(2)}, 0)
    with pytest.raises(SyncError, match="expected bytes or a readable binary stream"):
        r.apply(12)
