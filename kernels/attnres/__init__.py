"""Block Attention Residuals in K3's layout: references and the fused Triton kernels."""
from .naive import naive_block_attnres

__all__ = ["naive_block_attnres"]

try:  # the Triton kernels need triton (CUDA, or TRITON_INTERPRET=1 on CPU); the references never do
    from .fused import (AttnResGradSink, attnres_grad_sink, block_attnres_decode, fused_attnres,
                        fused_block_attnres)
except ImportError:  # pragma: no cover - triton missing
    pass
else:
    __all__ += ["AttnResGradSink", "attnres_grad_sink", "block_attnres_decode", "fused_attnres",
                "fused_block_attnres"]
