"""SiTU activation fused with the gate/up multiply."""
from .naive import naive_situ_and_mul

__all__ = ["naive_situ_and_mul"]
