"""benchmarks/kda_ab.py's version specs: what it runs must be what was asked for (no GPU needed here)."""
import os

import pytest

import torch

from benchmarks.kda_ab import _version, many_cu_seqlens, run_in_version

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_version_spec_parses_config_settings():
    assert _version("m=.") == ("m", ".", {})
    assert _version("p4=.ab/x+fwd_state_pieces=4+fwd_state_rest_bv=None+fwd_state_cut_last=True") == (
        "p4", ".ab/x", {"fwd_state_pieces": 4, "fwd_state_rest_bv": None, "fwd_state_cut_last": True})


@pytest.mark.parametrize("bad", ["a=.+fwd_state_pieces", "a=.+fwd_state_pieces=four", "a=.+=3"])
def test_version_spec_rejects_a_bad_setting_by_name(bad):
    with pytest.raises(SystemExit, match="is not key=<Python literal>"):
        _version(bad)


def test_worker_refuses_a_config_key_the_version_lacks():
    """A misspelt key must fail the version's run (named in its error), not silently time the defaults."""
    res = run_in_version(REPO, "benchmarks.kda_ab", ("--rows", "16K", "--config", '{"fwd_state_peices": 4}'))
    assert "fwd_state_peices" in res["error"]


def test_many_sequences_row_is_a_long_tailed_packed_batch():
    cu = many_cu_seqlens()
    lengths = cu.diff()
    assert cu[0] == 0 and cu[-1] == 65536 and len(lengths) == 32 and bool((lengths > 0).all())
    assert lengths.max() > 8 * lengths.median()  # a few long sequences among many short ones
    assert torch.equal(cu, many_cu_seqlens())  # the same batch every run


def test_named_rows_of_the_kda_benchmark_are_accepted():
    """The H96 and sharp-gate rows (benchmarks/kda.py's names) are where the forward is furthest from the goal: an
    A/B of launch settings must be able to time them, and a typo must not pass as a row."""
    from benchmarks.kda_ab import known_row
    assert known_row("16K") and known_row("16K_k3init_H96") and known_row("varlen_sharp_H16")
    assert not known_row("16K_k3init_H48") and not known_row("16k")


@pytest.mark.parametrize("args, message", [
    (["--rows", "16K_k3init_H48"], "unknown row"),
    (["--rows", "16K_k3init_H96", "--breakdown", "16K_precomputed_H16"], "fixed-length gated rows"),
])
def test_bad_rows_are_refused_before_any_gpu_work(args, message):
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-m", "benchmarks.kda_ab", "m=.", *args], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode != 0 and message in run.stderr, run.stderr[-2000:]
