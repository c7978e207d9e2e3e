"""RMSNorm and the gated RMSNorm of KDA's output."""
from .naive import naive_gated_rms_norm, naive_rms_norm

__all__ = ["naive_gated_rms_norm", "naive_rms_norm"]
