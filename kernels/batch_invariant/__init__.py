"""Batch-invariant matmul: a row's result depends only on its own values and the weight, never on how many rows
share the call (decode [B, 1] vs a verify [B, k+1], a prefill batch, any offset). Reference and Triton kernel."""
from .naive import naive_linear

__all__ = ["naive_linear"]

try:  # the Triton kernel needs triton (CUDA, or TRITON_INTERPRET=1 on CPU); the reference never does
    from .matmul import MatmulConfig, batch_invariant_linear, config_for
except ImportError:  # pragma: no cover - triton missing
    pass
else:
    __all__ += ["MatmulConfig", "batch_invariant_linear", "config_for"]
