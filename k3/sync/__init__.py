"""k3.sync: XOR-delta weight sync (trainer -> rollout engines).

Per tensor, the raw bytes of the new weights XOR the base version's, byte-plane shuffled and compressed
with zstd in bounded chunks on a thread pool; a manifest names the versions, chain, tensors (name, dtype,
shape) and every frame carries checksums. `WeightReceiver` applies payloads atomically. Transports: a
directory (atomic rename) and a local socket stream, both pipelined. CUDA tensors XOR on the GPU (Triton).
"""
from .chain import DEFAULT_FULL_EVERY, WeightPublisher
from .codec import DEFAULT_CHUNK_BYTES, DEFAULT_LEVEL, encode_delta, encode_full, iter_encode, new_chain_id
from .format import CorruptPayloadError, ManifestMismatchError, SyncError, VersionError
from .receiver import WeightReceiver, states_equal
from .transport import DirectoryTransport, atomic_write, send_payload, serve_socket

__all__ = [
    "DEFAULT_CHUNK_BYTES", "DEFAULT_FULL_EVERY", "DEFAULT_LEVEL", "CorruptPayloadError", "DirectoryTransport",
    "ManifestMismatchError", "SyncError", "VersionError", "WeightPublisher", "WeightReceiver", "atomic_write",
    "encode_delta", "encode_full", "iter_encode", "new_chain_id", "send_payload", "serve_socket", "states_equal",
]
