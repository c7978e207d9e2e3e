"""Shared utilities for the TorchTitan plugin tests: running TorchTitan's real entry point (torchrun, spawned gloo
ranks) on the plugin's CPU config, and reading its per-step metrics."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

CPU_CONFIG = "k3_tiny_cpu"
_STEP = re.compile(r"step:\s+(\d+)\s+loss:\s+([-\d.naninf]+)\s+grad_norm:\s+([-\d.naninf]+)")


@dataclass(frozen=True)
class StepMetrics:
    step: int
    loss: float
    grad_norm: float


def run_trainer(dump: Path, *args: str, nproc: int = 1, config: str = CPU_CONFIG, timeout: int = 300
                ) -> list[StepMetrics]:
    """`torchrun --nproc_per_node nproc -m torchtitan.train --module k3_torchtitan --config config` with
    TorchTitan CLI overrides `args`; returns rank 0's logged steps (TorchTitan logs the global loss and grad norm
    on every rank: the ranks must agree). Raises with the log tail when the run fails."""
    dump.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "torchtitan.train", "--module", "k3_torchtitan", "--config", config, "--dump_folder", str(dump),
           "--metrics.disable_color_printing", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=dump, env=env, capture_output=True, text=True, timeout=timeout)
    log = proc.stdout + proc.stderr
    (dump / "run.log").write_text(log)
    if proc.returncode != 0:
        raise AssertionError(f"trainer failed (rc {proc.returncode}): {' '.join(cmd)}\n{log[-6000:]}")
    per_step: dict[int, set[tuple[float, float]]] = {}
    for m in _STEP.finditer(log):
        per_step.setdefault(int(m.group(1)), set()).add((float(m.group(2)), float(m.group(3))))
    disagree = {s: v for s, v in per_step.items() if len(v) != 1}
    if disagree:
        raise AssertionError(f"ranks logged different global metrics: {disagree}")
    return [StepMetrics(s, *next(iter(v))) for s, v in sorted(per_step.items())]


def seed_args(seed_dir: Path) -> list[str]:
    """Start from the seed checkpoint (DTensor random init differs between 1 and 2 ranks; a checkpoint does not)."""
    return ["--checkpoint.enable", "--checkpoint.initial_load_path", str(seed_dir / "checkpoint" / "step-0"),
            "--checkpoint.load_only"]


def parallel_args(*, batch: int, dp_shard: int = 1, ep: int = 1, cp: int = 1, steps: int = 3) -> list[str]:
    return ["--training.local_batch_size", str(batch), "--training.steps", str(steps),
            "--parallelism.data_parallel_shard_degree", str(dp_shard),
            "--parallelism.expert_parallel_degree", str(ep), "--parallelism.context_parallel_degree", str(cp)]


def max_diff(a: list[StepMetrics], b: list[StepMetrics]) -> tuple[float, float]:
    """(max |loss difference|, max |grad-norm difference|) over the steps both runs logged."""
    assert [s.step for s in a] == [s.step for s in b], (a, b)
    return (max(abs(x.loss - y.loss) for x, y in zip(a, b)), max(abs(x.grad_norm - y.grad_norm) for x, y in zip(a, b)))
