"""Per-query MLA attention for decode and speculative verifies: each query reduces over exactly its own keys, in
fixed-size key blocks from the first, so its bits do not depend on the other queries of the call, on the padding of
the batch's key length, or on whether its keys sit at contiguous positions (decode, chain verify) or are gathered
(token-tree node). Spec: naive.py."""
from .naive import naive_query_attention

__all__ = ["naive_query_attention"]

try:  # the Triton kernel needs triton (CUDA, or TRITON_INTERPRET=1 on CPU); the reference never does
    from .attention import causal_key_index, mask_key_index, query_attention
except ImportError:  # pragma: no cover - triton missing
    pass
else:
    __all__ += ["causal_key_index", "mask_key_index", "query_attention"]
