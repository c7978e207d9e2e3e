"""Byte-wise XOR (XOR-delta weight sync): `naive_xor_bytes` reference; `xor_bytes` Triton kernel (imported
lazily so that importing this package never needs a GPU or sets Triton's mode)."""
from .naive import as_bytes, naive_xor_bytes

__all__ = ["as_bytes", "naive_xor_bytes", "xor_bytes"]


def __getattr__(name: str):
    if name == "xor_bytes":
        from .xor import xor_bytes

        return xor_bytes
    raise AttributeError(name)
