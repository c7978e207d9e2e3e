"""KDA (Kimi Delta Attention): plain-torch references (the spec) and the Triton kernels beside them."""
from .naive import (l2norm, naive_chunk_kda, naive_kda_gate, naive_kda_lowerbound_gate, naive_kda_step_inputs,
                    naive_recurrent_kda)

__all__ = ["l2norm", "naive_chunk_kda", "naive_kda_gate", "naive_kda_lowerbound_gate", "naive_kda_step_inputs",
           "naive_recurrent_kda"]

try:  # the Triton kernels need triton (CUDA, or TRITON_INTERPRET=1 on CPU); the references never do
    from .chunk import chunk_kda
    from .fused_recurrent import fused_recurrent_kda
except ImportError:  # pragma: no cover - triton missing
    pass
else:
    __all__ += ["chunk_kda", "fused_recurrent_kda"]
