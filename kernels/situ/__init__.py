"""SiTU activation fused with the gate/up multiply: reference and Triton kernel."""
from .naive import naive_situ_and_mul

__all__ = ["naive_situ_and_mul"]

try:  # the Triton kernel needs triton (CUDA, or TRITON_INTERPRET=1 on CPU); the reference never does
    from .fused import situ_and_mul
except ImportError:  # pragma: no cover - triton missing
    pass
else:
    __all__ += ["situ_and_mul"]
