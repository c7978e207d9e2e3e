"""The collective tests' rank spawner (tests/kernels/_spawned_ranks.py): a world whose rank died outside Python
runs once more (CI once saw gloo abort a rank), while a Python error in a rank, or a second death, still fails --
so the retry cannot hide a real failure of the code under test."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _spawned_ranks import dies_in_first_attempt, raises, spawn_ranks  # noqa: E402


def test_a_rank_dying_outside_python_once_is_run_again_and_errors_still_fail(tmp_path):
    with pytest.warns(UserWarning, match="runs once more"):
        assert spawn_ranks(dies_in_first_attempt, 2, tmp_path / "once") == [0, 1]
    with pytest.warns(UserWarning, match="runs once more"), pytest.raises(AssertionError, match="SIGABRT"):
        spawn_ranks(dies_in_first_attempt, 2, tmp_path / "always", True)
    with pytest.raises(AssertionError, match="rank 1's bad input"):
        spawn_ranks(raises, 2, tmp_path / "error")
    assert not (tmp_path / "error" / "attempt2").exists()   # a Python error is not retried
