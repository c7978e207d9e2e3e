"""K3 through TorchTitan 0.3.0's real entry point (`torchrun -m torchtitan.train --module k3_torchtitan`) on CPU:
spawned gloo ranks, fp32, every parallel run from one seed checkpoint. Parity: loss within 1e-4 and grad norm
within 1e-3 of one rank on the same global batch (FSDP and EP runs split the batch over 2 data-parallel ranks: the
1-rank reference takes both halves; CP runs split the sequence: the reference is the same batch on one rank)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from k3.lora import LoRAConfig
from k3_torchtitan import model_registry
from k3_torchtitan.lora import export_adapter

from k3_torchtitan.launch import (PARITY_SETTINGS, StepMetrics, max_diff, parallel_args, run_side_by_side,
                                  run_trainer)

LOSS_TOL, GRAD_NORM_TOL = 1e-4, 1e-3
PARITY = {s.name: s for s in PARITY_SETTINGS}


@pytest.fixture(scope="module")
def runs(titan_root, seed):
    root = titan_root / "trainer"
    out = {"root": root, "seed": seed}
    # the one-rank runs two at a time (each keeps one core busy)
    out.update(run_side_by_side(
        one_rank_b2=lambda: run_trainer(root / "one_b2", *seed, *parallel_args(batch=2, steps=5)),
        one_rank_b4=lambda: run_trainer(root / "one_b4", *seed, *parallel_args(batch=4)),
        r3=lambda: run_trainer(root / "r3", *seed, *parallel_args(batch=2, steps=3), config="k3_tiny_r3_cpu"),
        lora=lambda: run_trainer(root / "lora", "--checkpoint.enable", "--checkpoint.interval", "1",
                                 "--training.steps", "3", config="k3_tiny_lora_cpu")))
    # the FSDP run also writes a sharded DCP checkpoint after step 2 (the resume test starts a new job from it)
    fsdp = PARITY["fsdp2_full_ac"]
    out["fsdp2_full_ac"] = run_trainer(root / "fsdp2_full_ac", *seed[:-1], "--checkpoint.interval", "2",
                                       *fsdp.args(), nproc=2, config=fsdp.config)
    return out


def test_one_rank_five_steps_loss_falls(runs):
    steps = runs["one_rank_b2"]
    assert [s.step for s in steps] == [1, 2, 3, 4, 5]
    losses = [s.loss for s in steps]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.parametrize("name", sorted(PARITY))
def test_parallel_run_matches_one_rank(runs, name):
    setting = PARITY[name]
    got = runs.get(name) or run_trainer(runs["root"] / name, *runs["seed"], *setting.args(), nproc=2,
                                        config=setting.config)
    if "_ac" in name:
        assert "activation checkpointing on 8 decoder layers" in (runs["root"] / name / "run.log").read_text()
    ref = runs["one_rank_b4" if setting.reference_batch == 4 else "one_rank_b2"][:3]
    loss_diff, grad_diff = max_diff(got, ref)
    (runs["root"] / f"{name}.json").write_text(json.dumps({"ours": [s.__dict__ for s in got],
                                                           "one_rank": [s.__dict__ for s in ref]}))
    assert loss_diff <= LOSS_TOL and grad_diff <= GRAD_NORM_TOL, (name, got, ref)


def test_dcp_save_and_resume_gives_the_same_next_loss(runs):
    """FSDP = 2 with full AC: the sharded DCP checkpoint (model, optimizer, lr schedule, dataloader) the parity run
    wrote after step 2 starts a new job, whose step 3 equals the uninterrupted run's step 3."""
    fsdp = PARITY["fsdp2_full_ac"]
    folder = runs["root"] / "dcp"
    shutil.copytree(runs["root"] / "fsdp2_full_ac" / "checkpoint" / "step-2", folder / "checkpoint" / "step-2")
    resumed = run_trainer(folder, "--checkpoint.enable", "--checkpoint.load_only", *fsdp.args(), nproc=2,
                          config=fsdp.config)
    assert [s.step for s in resumed] == [3]
    uninterrupted = runs["fsdp2_full_ac"][2]
    assert abs(resumed[0].loss - uninterrupted.loss) <= LOSS_TOL and abs(
        resumed[0].grad_norm - uninterrupted.grad_norm) <= GRAD_NORM_TOL, (resumed, uninterrupted)
    shutil.rmtree(folder / "checkpoint")


def test_router_replay_through_the_trainer(runs):
    """Batches carrying a recorded routing: the trainer replays it (a different loss from free routing at the
    same weights from step 1 on), and still trains (the router learns through the replayed gate weights)."""
    free = runs["one_rank_b2"]
    replay = runs["r3"]   # k3_tiny_r3_cpu, 3 steps at batch 2 from the seed (the fixture's launch)
    assert abs(replay[0].loss - free[0].loss) > 5e-5   # logged with 5 decimals; the init's experts are small
    assert replay[-1].loss < replay[0].loss
    assert all(isinstance(s, StepMetrics) for s in replay)


def test_lora_through_the_trainer_trains_only_the_adapter(runs, tmp_path):
    """k3_tiny_lora_cpu: the base stays bitwise frozen across steps, every adapter tensor trains, the loss falls,
    and an adapter-only file is exported from the run's DCP checkpoint."""
    folder = runs["root"] / "lora"
    steps = runs["lora"]   # k3_tiny_lora_cpu, 3 steps, a DCP checkpoint after each (the fixture's launch)
    assert steps[-1].loss < steps[0].loss
    saved = {}
    for step in (1, 3):
        dcp_to_torch_save(folder / "checkpoint" / f"step-{step}", tmp_path / f"{step}.pt")
        saved[step] = torch.load(tmp_path / f"{step}.pt", weights_only=False)
    base = [k for k in saved[1] if k.startswith(("model.", "lm_head."))]
    adapter = [k for k in saved[1] if k.startswith("lora.")]
    assert base and adapter
    assert all(torch.equal(saved[1][k], saved[3][k]) for k in base)
    assert all(not torch.equal(saved[1][k], saved[3][k]) for k in adapter)
    cfg = model_registry("k3_tiny").model
    cfg.lora = LoRAConfig.preset("tiny")
    model = cfg.build()
    export_adapter(folder / "checkpoint" / "step-3", model, tmp_path / "adapter.safetensors")
    exported = load_file(str(tmp_path / "adapter.safetensors"))
    assert len(exported) == len(adapter) and all(k.endswith((".lora_A", ".lora_B")) for k in exported)
    assert all(torch.equal(model.lora.state_dict()[k[len("lora."):]], saved[3][k]) for k in adapter)
    shutil.rmtree(folder / "checkpoint")
