"""GSPO inside TorchTitan's own loop (`--config k3_tiny_gspo_cpu`: K3GSPOTrainer, GSPOLoss, RLBatchDataLoader) on
an RL batch file, through the real entry point: each step's logged loss is k3.rl's GSPO on the same rows with
k3.model loaded from the weights the step started from (the seed, then the run's step-1 checkpoint: the GSPO
gradient went through TorchTitan's optimizer); CP = 2 matches one rank; Router Replay on/off changes the routing
and nothing else (own routing replayed = free routing; off = the reference without routing), with CP too."""
from __future__ import annotations

import pytest
import torch

from k3.model import K3ForCausalLM
from k3.rl import gspo_loss
from k3_torchtitan.config_registry import k3_tiny_gspo_cpu
from k3_torchtitan.launch import max_diff, model_from_dcp, parallel_args, run_side_by_side, run_trainer
from k3_torchtitan.rl_data import RLBatchDataLoader, example_rl_batch, label_logp, write_rl_batch

CONFIG = "k3_tiny_gspo_cpu"
LOSS_TOL, GRAD_NORM_TOL = 1e-4, 1e-3
LOGGED = 1.5e-5  # TorchTitan logs the loss to 5 decimals
ROWS, SEQ, BATCH = 4, 32, 2


def _reference(model, batch, rows, routed: bool) -> float:
    loss_cfg = k3_tiny_gspo_cpu().loss
    tokens, mask = batch["tokens"][rows], batch["response_mask"][rows]
    logp = label_logp(model, tokens, batch["routed_experts"][rows] if routed else None)
    loss, _ = gspo_loss(logp, batch["old_logp"][rows], batch["advantages"][rows], mask, loss_cfg.eps_low,
                        loss_cfg.eps_high, agg="token-mean", num_tokens=mask.sum())
    return float(loss)


@pytest.fixture(scope="module")
def gspo(titan_root, seed):
    root = titan_root / "gspo"
    seed_model = model_from_dcp(seed[2])
    batch = example_rl_batch(seed_model, rows=ROWS, seq_len=SEQ)
    path = write_rl_batch(root / "batch.safetensors", **batch)
    data = ["--dataloader.path", str(path)]
    out = {"batch": batch, "seed_model": seed_model, "root": root}
    # one rank, R3 on, saving step 1 (the weights step 2 starts from), beside one rank with R3 off (free routing)
    out.update(run_side_by_side(
        one_rank=lambda: run_trainer(root / "one", *seed[:-1], "--checkpoint.interval", "1", *data,
                                     *parallel_args(batch=BATCH, steps=2), config=CONFIG),
        free=lambda: run_trainer(root / "free", *seed, *data, "--dataloader.no-router-replay",
                                 *parallel_args(batch=BATCH, steps=1), config=CONFIG)))
    out["cp2"] = run_trainer(root / "cp2", *seed, *data, *parallel_args(batch=BATCH, cp=2, steps=2), nproc=2,
                             config=CONFIG)
    return out


def test_each_step_is_k3_rl_gspo_at_the_weights_it_started_from(gspo):
    batch, steps = gspo["batch"], gspo["one_rank"]
    assert [s.step for s in steps] == [1, 2] and all(s.grad_norm > 0 for s in steps)
    assert abs(steps[0].loss - _reference(gspo["seed_model"], batch, [0, 1], routed=True)) <= LOGGED, steps
    after_one = model_from_dcp(gspo["root"] / "one" / "checkpoint" / "step-1")
    assert abs(steps[1].loss - _reference(after_one, batch, [2, 3], routed=True)) <= LOGGED, steps
    # the step did move the weights: the same rows at the seed give another loss
    assert abs(steps[1].loss - _reference(gspo["seed_model"], batch, [2, 3], routed=True)) > 10 * LOGGED


def test_context_parallel_gspo_matches_one_rank(gspo):
    loss_diff, grad_diff = max_diff(gspo["cp2"], gspo["one_rank"])
    assert loss_diff <= LOSS_TOL and grad_diff <= GRAD_NORM_TOL, (gspo["cp2"], gspo["one_rank"])


def test_router_replay_changes_only_the_routing(gspo):
    batch, model = gspo["batch"], gspo["seed_model"]
    free = gspo["free"][0]
    assert abs(free.loss - _reference(model, batch, [0, 1], routed=False)) <= LOGGED
    assert abs(free.loss - gspo["one_rank"][0].loss) > 10 * LOGGED  # the recorded routing is not the live one
    assert abs(free.grad_norm - gspo["one_rank"][0].grad_norm) > 1e-3
    # replaying the model's own routing is free routing, bit for bit
    tokens = batch["tokens"][:2, :-1]
    own = K3ForCausalLM.forward(model, tokens, use_cache=False, return_routed_experts=True).routed_experts
    assert torch.equal(label_logp(model, batch["tokens"][:2], own), label_logp(model, batch["tokens"][:2]))


def test_rl_batch_file_errors_name_the_field(tmp_path, gspo):
    good = {k: v for k, v in gspo["batch"].items()}
    with pytest.raises(ValueError, match="advantages must be finite"):
        write_rl_batch(tmp_path / "bad.safetensors", **(good | {"advantages": torch.tensor([1.0, float("nan"), 0, 0])}))
    with pytest.raises(ValueError, match="response_mask: rows \\[2\\] have no response"):
        mask = good["response_mask"].clone()
        mask[2] = False
        write_rl_batch(tmp_path / "bad.safetensors", **(good | {"response_mask": mask}))
    path = write_rl_batch(tmp_path / "ok.safetensors", **good)
    kw = dict(dp_world_size=1, dp_rank=0, tokenizer=None, local_batch_size=2)
    with pytest.raises(ValueError, match="training.seq_len: 16"):
        RLBatchDataLoader.Config(path=str(path)).build(seq_len=16, **kw)
    with pytest.raises(ValueError, match="dataloader.path"):
        RLBatchDataLoader.Config().build(seq_len=SEQ, **kw)
    inputs, labels = next(iter(RLBatchDataLoader.Config(path=str(path), router_replay=False).build(seq_len=SEQ, **kw)))
    assert set(inputs) == {"input", "positions", "old_logp", "advantages"}
    assert torch.equal(labels != -100, good["response_mask"][:2])
