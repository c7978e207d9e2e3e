"""KDA (Kimi Delta Attention): references here; Triton kernels are added beside them."""
from .naive import l2norm, naive_chunk_kda, naive_kda_gate, naive_kda_lowerbound_gate, naive_recurrent_kda

__all__ = ["l2norm", "naive_chunk_kda", "naive_kda_gate", "naive_kda_lowerbound_gate", "naive_recurrent_kda"]
