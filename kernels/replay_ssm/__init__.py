"""ReplaySSM commit for KDA (speculative decoding): the plain-torch reference (the spec) and the Triton fold."""
from .naive import check_replay_inputs, naive_conv_roll, naive_replay_commit

__all__ = ["check_replay_inputs", "naive_conv_roll", "naive_replay_commit"]

try:  # the Triton kernel needs triton (CUDA, or TRITON_INTERPRET=1 on CPU); the reference never does
    from .replay import replay_commit
except ImportError:  # pragma: no cover - triton missing
    pass
else:
    __all__ += ["replay_commit"]
