"""benchmarks/titan_multigpu.py on CPU (gloo, 2 ranks, k3_tiny): the script the multi-GPU machine runs, checked
here on every setting it ships with: each 2-rank run (FSDP2, EP2 + FSDP, CP2, CP2 + EP2) built through the plugin's
ModelSpec and parallelize_fn without TorchTitan's Trainer must train like the 1-rank reference from the same seed
weights and global batch, step for step (losses and grad norms to fp32 rounding)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.titan_multigpu import Setting, check_setting, parse_setting
from k3_torchtitan.launch import StepMetrics, TrainerRunError, max_diff

ROOT = Path(__file__).resolve().parents[3]
SETTINGS = ("fsdp2", "ep2", "cp2", "cp2ep2")
STEPS = 3


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("titan_multigpu") / "titan_multigpu.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "benchmarks.titan_multigpu", "--device", "cpu", "--flavor", "k3_tiny", "--seq-len", "32",
           "--local-batch", "1", "--steps", str(STEPS), "--warmup", "1", "--settings", ",".join(SETTINGS),
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
                          capture_output=True, text=True, timeout=240)
    if proc.returncode != 0:
        raise TrainerRunError(f"titan_multigpu failed (rc {proc.returncode}): {' '.join(cmd)}\n"
                              f"{(proc.stdout + proc.stderr)[-6000:]}")
    return json.loads(out.read_text())


def _metrics(run: dict) -> list[StepMetrics]:
    return [StepMetrics(i + 1, loss, norm) for i, (loss, norm) in enumerate(zip(run["losses"], run["grad_norms"]))]


@pytest.mark.parametrize("name", SETTINGS)
def test_parallel_run_trains_like_the_one_rank_reference(result, name):
    row = result["rows"][name]
    ref, par = row["reference"], row["parallel"]
    assert len(ref["losses"]) == len(par["losses"]) == STEPS
    # the steps train (AdamW moves the loss), so later steps compare updated weights, not only the seed
    assert len(set(ref["losses"])) == STEPS and min(ref["grad_norms"]) > 0
    d_loss, d_norm = max_diff(_metrics(ref), _metrics(par))
    assert d_loss == row["max_abs_loss_diff"] and d_norm == row["max_abs_grad_norm_diff"]
    assert d_loss < 1e-4, (name, ref["losses"], par["losses"])
    assert d_norm < 1e-3 * max(1.0, max(ref["grad_norms"])), (name, ref["grad_norms"], par["grad_norms"])
    assert par["tokens_per_s"] > 0 and ref["tokens_per_s"] > 0


def test_meshes_are_the_settings_degrees_on_two_ranks(result):
    dims = {name: row["dims"] for name, row in result["rows"].items()}
    assert dims == {"fsdp2": {"dp_shard": 2, "ep": 1, "cp": 1, "world": 2},
                    "ep2": {"dp_shard": 2, "ep": 2, "cp": 1, "world": 2},
                    "cp2": {"dp_shard": 1, "ep": 1, "cp": 2, "world": 2},
                    "cp2ep2": {"dp_shard": 1, "ep": 2, "cp": 2, "world": 2}}
    assert result["benchmark"] == "titan_multigpu" and result["commit"] and result["world"] == 2


def test_setting_names_parse_to_degrees_and_bad_ones_are_named():
    assert parse_setting("cp2ep2") == Setting("cp2ep2", dp_shard=-1, ep=2, cp=2)
    assert parse_setting("fsdp4ep2") == Setting("fsdp4ep2", dp_shard=4, ep=2, cp=1)
    for bad in ("tp2", "cp2x", "ep0", "cp2cp2", ""):
        with pytest.raises(ValueError, match="--settings"):
            parse_setting(bad)


def test_settings_the_world_or_model_cannot_run_are_refused_naming_them():
    ok = dict(world=2, seq_len=32, num_experts=8)
    for s in ("fsdp2", "ep2", "cp2", "cp2ep2"):
        check_setting(parse_setting(s), **ok)
    with pytest.raises(ValueError, match=r"'cp4'.*world size \(2"):
        check_setting(parse_setting("cp4"), **ok)
    with pytest.raises(ValueError, match=r"'fsdp4'.*world size"):
        check_setting(parse_setting("fsdp4"), **ok)
    with pytest.raises(ValueError, match=r"'ep4'.*ep 4 must divide"):
        check_setting(parse_setting("ep4"), **ok)
    with pytest.raises(ValueError, match=r"'ep2'.*3 experts"):
        check_setting(parse_setting("ep2"), world=2, seq_len=32, num_experts=3)
    with pytest.raises(ValueError, match=r"--seq-len: 30 .*'cp2'"):
        check_setting(parse_setting("cp2"), world=2, seq_len=30, num_experts=8)
