"""ReplaySSM for KDA (speculative decoding): the commit fold of an accepted chain and the verify of a token tree
(each node from its parent's state, inputs only), plain-torch references (the spec, naive.py) and Triton kernels
(replay.py, tree.py)."""
from .naive import (check_replay_inputs, check_state_rows, check_tree_inputs, naive_conv_roll, naive_replay_commit,
                    naive_replay_commit_into, naive_tree_verify, path_inputs, tree_paths)

__all__ = ["check_replay_inputs", "check_state_rows", "check_tree_inputs", "naive_conv_roll", "naive_replay_commit",
           "naive_replay_commit_into", "naive_tree_verify", "path_inputs", "tree_paths"]

try:  # the Triton kernel needs triton (CUDA, or TRITON_INTERPRET=1 on CPU); the reference never does
    from .replay import replay_commit, replay_commit_into
    from .tree import tree_verify
except ImportError:  # pragma: no cover - triton missing
    pass
else:
    __all__ += ["replay_commit", "replay_commit_into", "tree_verify"]
