"""Token picking on the device: the greedy token of each logits row and its log-probability, in one pass per row
whose bits do not depend on the other rows of the call. Spec: naive.py."""
from .naive import naive_greedy_pick

__all__ = ["naive_greedy_pick"]

try:  # the Triton kernel needs triton (CUDA, or TRITON_INTERPRET=1 on CPU); the reference never does
    from .greedy import greedy_pick
except ImportError:  # pragma: no cover - triton missing
    pass
else:
    __all__ += ["greedy_pick"]
