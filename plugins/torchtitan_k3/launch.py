"""Launching TorchTitan's real entry point on the plugin's configs and reading what it logs: shared by the CPU tests
(tests/plugins/torchtitan_k3) and the parity benchmark (benchmarks/torchtitan_parity.py), so both run the same
command lines.

    run_trainer(dump, *seed_args(seed), *parallel_args(batch=2, cp=2), nproc=2)
        = torchrun --standalone --nproc_per_node 2 -m torchtitan.train --module k3_torchtitan --config k3_tiny_cpu ...
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")

CPU_CONFIG = "k3_tiny_cpu"
_STEP = re.compile(r"step:\s+(\d+)\s+loss:\s+([-\d.naninf]+)\s+grad_norm:\s+([-\d.naninf]+)")


@dataclass(frozen=True)
class StepMetrics:
    step: int
    loss: float
    grad_norm: float

    def as_dict(self) -> dict:
        return asdict(self)


class TrainerRunError(AssertionError):
    """A trainer launch failed or its ranks logged different global metrics (the message holds the log tail)."""


def trainer_command(dump: Path, *args: str, nproc: int = 1, config: str = CPU_CONFIG) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "-m", "torchtitan.train", "--module", "k3_torchtitan", "--config", config, "--dump_folder", str(dump),
            "--metrics.disable_color_printing", *args]


def run_side_by_side(workers: int = 2, **launches: Callable[[], T]) -> dict[str, T]:
    """Runs independent one-rank launches `workers` at a time and returns each one's result by name. A launch is
    mostly single-threaded imports (TorchTitan's entry point imports for ~16 s on CI's cores), so one-rank runs
    one after another leave a core idle; a failed launch raises when its result is read, the others finish."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {name: pool.submit(fn) for name, fn in launches.items()}
        return {name: f.result() for name, f in futures.items()}


def run_trainer(dump: Path, *args: str, nproc: int = 1, config: str = CPU_CONFIG, timeout: int = 300
                ) -> list[StepMetrics]:
    """`torchrun --nproc_per_node nproc -m torchtitan.train --module k3_torchtitan --config config` with
    TorchTitan CLI overrides `args`, its log kept in dump/run.log; returns rank 0's logged steps (TorchTitan logs
    the global loss and grad norm on every rank: the ranks must agree). Raises TrainerRunError with the log tail
    when the run fails."""
    dump = Path(dump)
    dump.mkdir(parents=True, exist_ok=True)
    cmd = trainer_command(dump, *args, nproc=nproc, config=config)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=dump, env=env, capture_output=True, text=True, timeout=timeout)
    log = proc.stdout + proc.stderr
    (dump / "run.log").write_text(log)
    if proc.returncode != 0:
        raise TrainerRunError(f"trainer failed (rc {proc.returncode}): {' '.join(cmd)}\n{log[-6000:]}")
    per_step: dict[int, set[tuple[float, float]]] = {}
    for m in _STEP.finditer(log):
        per_step.setdefault(int(m.group(1)), set()).add((float(m.group(2)), float(m.group(3))))
    disagree = {s: v for s, v in per_step.items() if len(v) != 1}
    if disagree:
        raise TrainerRunError(f"ranks logged different global metrics: {disagree}")
    return [StepMetrics(s, *next(iter(v))) for s, v in sorted(per_step.items())]


def create_seed(dump: Path, config: str = CPU_CONFIG) -> list[str]:
    """Write a 1-rank seed checkpoint under dump and return the arguments that start a run from it."""
    run_trainer(dump, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint", config=config)
    return seed_args(dump)


def seed_args(seed_dir: Path) -> list[str]:
    """Start from the seed checkpoint (DTensor random init differs between 1 and 2 ranks; a checkpoint does not)."""
    return ["--checkpoint.enable", "--checkpoint.initial_load_path", str(Path(seed_dir) / "checkpoint" / "step-0"),
            "--checkpoint.load_only"]


def parallel_args(*, batch: int, dp_shard: int = 1, ep: int = 1, cp: int = 1, steps: int = 3) -> list[str]:
    return ["--training.local_batch_size", str(batch), "--training.steps", str(steps),
            "--parallelism.data_parallel_shard_degree", str(dp_shard),
            "--parallelism.expert_parallel_degree", str(ep), "--parallelism.context_parallel_degree", str(cp)]


def max_diff(a: list[StepMetrics], b: list[StepMetrics]) -> tuple[float, float]:
    """(max |loss difference|, max |grad-norm difference|) over the steps both runs logged."""
    if [s.step for s in a] != [s.step for s in b]:
        raise ValueError(f"runs logged different steps: {[s.step for s in a]} vs {[s.step for s in b]}")
    return (max(abs(x.loss - y.loss) for x, y in zip(a, b)), max(abs(x.grad_norm - y.grad_norm) for x, y in zip(a, b)))


@dataclass(frozen=True)
class ParitySetting:
    """A 2-rank run and its 1-rank reference on the same global batch: FSDP and EP runs split the batch over 2
    data-parallel ranks (the reference takes both halves: `reference_batch` = 2 x `batch`); CP runs split the
    sequence (the reference is the same batch on one rank)."""
    name: str
    config: str
    batch: int
    reference_batch: int
    dp_shard: int = 1
    ep: int = 1
    cp: int = 1

    def args(self, steps: int = 3) -> list[str]:
        return parallel_args(batch=self.batch, dp_shard=self.dp_shard, ep=self.ep, cp=self.cp, steps=steps)


#: the settings CI and the parity benchmark run (activation checkpointing rides along two of them)
PARITY_SETTINGS = (
    ParitySetting("fsdp2_full_ac", "k3_tiny_full_ac_cpu", batch=2, reference_batch=4, dp_shard=2),
    ParitySetting("ep2_fsdp2", CPU_CONFIG, batch=2, reference_batch=4, dp_shard=2, ep=2),
    ParitySetting("cp2_selective_ac", "k3_tiny_selective_ac_cpu", batch=2, reference_batch=2, cp=2),
    ParitySetting("cp2_ep2", CPU_CONFIG, batch=2, reference_batch=2, cp=2, ep=2),
)


def model_from_dcp(checkpoint: str | Path, flavor: str = "k3_tiny"):
    """A `k3.model.K3ForCausalLM` holding the model weights of a TorchTitan DCP checkpoint folder (any step, any
    number of ranks wrote it): how the tests compare a run's weights with in-process references."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from k3.model import K3ForCausalLM

    from . import model_config

    with tempfile.TemporaryDirectory() as d:
        dcp_to_torch_save(str(checkpoint), f"{d}/state.pt")
        state = torch.load(f"{d}/state.pt", weights_only=False)
    model = K3ForCausalLM(model_config(flavor).k3, init=False)
    model.load_state_dict({k: v for k, v in state.items() if k.startswith(("model.", "lm_head."))})
    return model.eval()
