"""Wire format of a k3.sync payload (one self-describing, self-delimiting byte stream).

    header   MAGIC(8) | u32 len | zstd(manifest JSON) | u64 xxh3(compressed manifest)
    frame*   FRAME header (fixed struct, below) | u64 xxh3(frame header + data) | zstd data
    trailer  b"K3EN" | u64 frame count | u64 xxh3(all frame checksums) | u64 xxh3(JSON)

A delta chunk whose XOR has few non-zero words (the usual case: most bf16 weights keep their value at RL
learning rates) is stored sparse: gap-coded positions and the non-zero XOR words, byte-plane split; a
denser chunk is stored dense (XOR bytes, byte-plane shuffled). Either way zstd compresses the result.
The manifest names the payload kind ("full" or "delta"), the base and new versions, the chain id, the
chunk size, and every tensor's name, dtype, shape, byte size, byte-plane shuffle and frame count.
Each frame is one bounded chunk of one tensor's raw bytes (for a delta: new XOR base), compressed as one
zstd frame; its record carries the checksum of the record itself and of the decoded bytes (and of the new
bytes when the sender had them on the host). Frames appear in manifest order, so a receiver can check
the structure as the stream arrives. The trailer makes truncation detectable.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
import zstandard as zstd

MAGIC = b"K3SYNC\x00\x01"
FORMAT_VERSION = 1
FRAME_MAGIC = b"K3FR"
END_MAGIC = b"K3EN"
# magic, tensor index, chunk index, byte offset, raw length, compressed length, xxh3(raw), xxh3(new), flags
FRAME = struct.Struct("<4sIIQIIQQI")
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
TRAILER = struct.Struct("<4sQQQ")
FLAG_NEW_HASH = 1  # the frame's xxh3(new) field is set (sender had the new bytes on the host)
FLAG_SPARSE = 2  # delta frame stored sparse: gap-coded positions + XOR words (see codec.pack_sparse)
MAX_MANIFEST_BYTES = 64 << 20

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.complex64, torch.complex128)}


class SyncError(ValueError):
    """A payload was refused; the message names the tensor/field at fault. The receiver is unchanged."""


class VersionError(SyncError):
    """The payload's base version (or chain) is not the receiver's current one."""


class CorruptPayloadError(SyncError):
    """The payload's bytes are damaged: bad magic, checksum mismatch, truncation, malformed record."""


class ManifestMismatchError(SyncError):
    """The payload's tensors (names, dtypes, shapes) do not match the receiver's."""


def dtype_name(dtype: torch.dtype) -> str:
    """Manifest name of a dtype ('bfloat16', 'float8_e4m3fn', ...)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise SyncError(f"dtype {dtype} is not supported by k3.sync")
    return name


def dtype_from_name(name: str, where: str) -> torch.dtype:
    """Inverse of `dtype_name`; `where` names the tensor for the error message."""
    if name not in _DTYPES:
        raise CorruptPayloadError(f"tensor {where!r}: unknown dtype {name!r} in manifest")
    return _DTYPES[name]


def xxh3(data: Any) -> int:
    """xxh3-64 of a buffer (bytes, memoryview or contiguous numpy array)."""
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a manifest."""
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    shuffle: int  # byte-plane shuffle width (the dtype's itemsize) or 1 for none
    frames: int
    itemsize: int


@dataclass(frozen=True)
class Manifest:
    """Decoded payload header."""
    kind: str
    base_version: int | None
    new_version: int
    chain: str | None
    chunk_bytes: int
    level: int
    tensors: tuple[TensorEntry, ...]
    raw_json: bytes

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def total_frames(self) -> int:
        return sum(t.frames for t in self.tensors)


def pack_header(meta: dict) -> tuple[bytes, bytes]:
    """Serialize the manifest dict; returns (header bytes, JSON bytes). The JSON is zstd-compressed (tensor
    names repeat: a few hundred tensors' manifest would otherwise weigh more than a small model's delta)."""
    js = json.dumps(meta, separators=(",", ":"), sort_keys=True).encode()
    comp = zstd.ZstdCompressor(level=3).compress(js)
    return MAGIC + U32.pack(len(comp)) + comp + U64.pack(xxh3(comp)), js


def unpack_manifest_json(comp: bytes) -> bytes:
    """Decompress a manifest whose checksum was verified."""
    try:
        return zstd.ZstdDecompressor().decompress(comp, max_output_size=MAX_MANIFEST_BYTES)
    except zstd.ZstdError as e:
        raise CorruptPayloadError(f"header: manifest does not decompress ({e})") from None


def parse_manifest(js: bytes) -> Manifest:
    """Validate and decode the manifest JSON (its checksum was already verified)."""
    try:
        meta = json.loads(js)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptPayloadError(f"manifest: not valid JSON ({e})") from None
    if meta.get("format") != "k3sync" or meta.get("format_version") != FORMAT_VERSION:
        raise CorruptPayloadError(f"manifest: unsupported format {meta.get('format')!r} "
                                  f"version {meta.get('format_version')!r}")
    kind = meta.get("kind")
    if kind not in ("full", "delta"):
        raise CorruptPayloadError(f"manifest field 'kind': {kind!r} is neither 'full' nor 'delta'")
    new_v, base_v = meta.get("new_version"), meta.get("base_version")
    if not isinstance(new_v, int) or new_v < 0:
        raise CorruptPayloadError(f"manifest field 'new_version': {new_v!r} is not a version number")
    if kind == "delta" and (not isinstance(base_v, int) or base_v < 0):
        raise CorruptPayloadError(f"manifest field 'base_version': {base_v!r} is not a version number")
    chunk = meta.get("chunk_bytes")
    if not isinstance(chunk, int) or chunk <= 0 or chunk % 16:
        raise CorruptPayloadError(f"manifest field 'chunk_bytes': {chunk!r} is not a positive multiple of 16")
    entries, seen = [], set()
    for i, t in enumerate(meta.get("tensors", [])):
        name = t.get("name")
        if not isinstance(name, str) or name in seen:
            raise CorruptPayloadError(f"manifest tensor #{i}: missing or duplicate name {name!r}")
        seen.add(name)
        dtype = dtype_from_name(t.get("dtype"), name)
        shape = tuple(t.get("shape", ()))
        if not all(isinstance(s, int) and s >= 0 for s in shape):
            raise CorruptPayloadError(f"tensor {name!r}: bad shape {shape!r} in manifest")
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = 1
        for s in shape:
            numel *= s
        nbytes, frames, shuffle = t.get("nbytes"), t.get("frames"), t.get("shuffle", 1)
        if nbytes != numel * itemsize:
            raise CorruptPayloadError(f"tensor {name!r}: manifest nbytes {nbytes!r} != shape x itemsize "
                                      f"{numel * itemsize}")
        if frames != -(-nbytes // chunk):
            raise CorruptPayloadError(f"tensor {name!r}: manifest frame count {frames!r} does not match "
                                      f"nbytes/chunk_bytes")
        if shuffle not in (1, itemsize):
            raise CorruptPayloadError(f"tensor {name!r}: manifest shuffle {shuffle!r} is not 1 or {itemsize}")
        entries.append(TensorEntry(name, dtype, shape, nbytes, shuffle, frames, itemsize))
    return Manifest(kind, base_v if kind == "delta" else None, new_v, meta.get("chain"), chunk,
                    int(meta.get("level", 0)), tuple(entries), js)
