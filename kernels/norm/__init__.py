"""RMSNorm and the gated RMSNorm of KDA's output: references and batch-invariant Triton kernels."""
from .naive import naive_gated_rms_norm, naive_rms_norm

__all__ = ["naive_gated_rms_norm", "naive_rms_norm"]

try:  # the Triton kernels need triton (CUDA, or TRITON_INTERPRET=1 on CPU); the references never do
    from .fused import gated_rms_norm, rms_norm
except ImportError:  # pragma: no cover - triton missing
    pass
else:
    __all__ += ["gated_rms_norm", "rms_norm"]
