"""Parity of K3's parallel training in TorchTitan 0.3.0's real entry point (`torchrun -m torchtitan.train --module
k3_torchtitan`) on CPU with gloo: each 2-rank setting (FSDP = 2, EP = 2 + FSDP = 2, CP = 2, CP = 2 + EP = 2) and its
1-rank reference on the same global batch, all from one seed checkpoint (k3_tiny, fp32, seq 32, 3 steps): the losses
and grad norms both runs logged and their max differences. The settings and launch code are the tests'
(k3_torchtitan.launch.PARITY_SETTINGS, run_trainer), so this file records what CI asserts.

GSPO through the same loop (`--config k3_tiny_gspo_cpu`, K3GSPOTrainer on an RL batch file with Router Replay):
FSDP = 2, CP = 2 and CP = 2 + EP = 2 against 1 rank on the same rollouts, 2 steps.

It also records MLA's context-parallel work per rank: score elements (queries x keys its attention computes, per
batch row and head) of the load-balanced `CPGatedMLA` against contiguous shards (`ContiguousCPGatedMLA`), counted
inside spawned gloo ranks running the layer (k3_torchtitan.cp_check, with the layer's max difference from the
unsharded forward/backward), and from the closed form at K3's training length.

    python -m benchmarks.torchtitan_parity             # -> benchmarks/results/torchtitan_parity.json (~12 min, 2 shared cores)
"""
from __future__ import annotations

import argparse
import tempfile
from dataclasses import asdict
from pathlib import Path

from benchmarks._results import run_header, write_results


def parity(root: Path, seed: list[str], steps: int) -> list[dict]:
    from k3_torchtitan.launch import PARITY_SETTINGS, max_diff, parallel_args, run_trainer

    references = {b: run_trainer(root / f"one_rank_b{b}", *seed, *parallel_args(batch=b, steps=steps))
                  for b in sorted({s.reference_batch for s in PARITY_SETTINGS})}
    rows = []
    for setting in PARITY_SETTINGS:
        got = run_trainer(root / setting.name, *seed, *setting.args(steps), nproc=2, config=setting.config)
        ref = references[setting.reference_batch]
        loss_diff, grad_diff = max_diff(got, ref)
        rows.append({"setting": setting.name, "config": setting.config,
                     "two_ranks": {"batch": setting.batch, "dp_shard": setting.dp_shard, "ep": setting.ep,
                                   "cp": setting.cp},
                     "one_rank_batch": setting.reference_batch,
                     "loss_two_ranks": [s.loss for s in got], "loss_one_rank": [s.loss for s in ref],
                     "grad_norm_two_ranks": [s.grad_norm for s in got], "grad_norm_one_rank": [s.grad_norm for s in ref],
                     "max_abs_loss_diff": loss_diff, "max_abs_grad_norm_diff": grad_diff})
        print(f"{setting.name:18s} loss {' '.join(f'{s.loss:.5f}' for s in got)} | 1 rank "
              f"{' '.join(f'{s.loss:.5f}' for s in ref)} | max d loss {loss_diff:.1e}, d grad norm {grad_diff:.1e}")
    return rows


def gspo_parity(root: Path, seed: list[str], steps: int = 2) -> list[dict]:
    from k3_torchtitan.launch import max_diff, model_from_dcp, parallel_args, run_trainer
    from k3_torchtitan.rl_data import example_rl_batch, write_rl_batch

    batch = example_rl_batch(model_from_dcp(seed[2]), rows=4 * steps, seq_len=32)
    data = ["--dataloader.path", str(write_rl_batch(root / "rollouts.safetensors", **batch))]
    config = "k3_tiny_gspo_cpu"
    refs = {b: run_trainer(root / f"gspo_one_rank_b{b}", *seed, *data, *parallel_args(batch=b, steps=steps),
                           config=config) for b in (2, 4)}
    rows = []
    for name, kw, ref_batch in (("gspo_fsdp2", dict(dp_shard=2), 4), ("gspo_cp2", dict(cp=2), 2),
                                ("gspo_cp2_ep2", dict(cp=2, ep=2), 2)):
        got = run_trainer(root / name, *seed, *data, *parallel_args(batch=2, steps=steps, **kw), nproc=2,
                          config=config)
        ref = refs[ref_batch]
        loss_diff, grad_diff = max_diff(got, ref)
        rows.append({"setting": name, "config": config, "two_ranks": {"batch": 2, **kw}, "one_rank_batch": ref_batch,
                     "loss_two_ranks": [s.loss for s in got], "loss_one_rank": [s.loss for s in ref],
                     "grad_norm_two_ranks": [s.grad_norm for s in got], "grad_norm_one_rank": [s.grad_norm for s in ref],
                     "max_abs_loss_diff": loss_diff, "max_abs_grad_norm_diff": grad_diff})
        print(f"{name:18s} loss {' '.join(f'{s.loss:.5f}' for s in got)} | 1 rank "
              f"{' '.join(f'{s.loss:.5f}' for s in ref)} | max d loss {loss_diff:.1e}, d grad norm {grad_diff:.1e}")
    return rows


def mla_work(cps: tuple[int, ...], seq_len: int, k3_seq_len: int) -> dict:
    from k3_torchtitan.context_parallel import mla_score_elements
    from k3_torchtitan.cp_check import check_mla

    measured = []
    for cp in cps:
        for variant in ("balanced", "contiguous"):
            check = check_mla(cp, seq_len, variant)
            measured.append(asdict(check))
            work = check.score_elements
            print(f"MLA CP = {cp} {variant:10s} score elements per rank {work} (max/min {max(work) / min(work):.2f}); "
                  f"|d out| {check.max_abs_out:.1e} of {check.ref_abs_out:.1e}, |d grad x| {check.max_abs_grad_x:.1e}, "
                  f"|d grad params| {check.max_abs_grad_params:.1e} of {check.ref_abs_grad_params:.1e}")
    closed = {str(cp): {v: mla_score_elements(k3_seq_len, cp, balanced=v == "balanced")
                        for v in ("balanced", "contiguous")} for cp in (2, 4, 8)}
    return {"measured_seq_len": seq_len, "measured": measured, "closed_form_seq_len": k3_seq_len,
            "closed_form": closed,
            "unit": "query x key score elements per rank, per batch row and head, one MLA layer"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="torchtitan_parity")
    ap.add_argument("--keep", help="folder for the runs' dumps (default: a temporary one)")
    args = ap.parse_args()
    result = run_header("torchtitan_parity", device="cpu", packages=("torchtitan",))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp)
        result["settings"] = {"flavor": "k3_tiny", "dtype": "float32", "seq_len": 32, "steps": args.steps,
                              "backend": "gloo", "start": "one seed checkpoint (1 rank)",
                              "logged_precision": "TorchTitan logs loss to 5 decimals, grad norm to 4"}
        from k3_torchtitan.launch import create_seed

        seed = create_seed(root / "seed")
        result["parity"] = parity(root, seed, args.steps)
        result["gspo_parity"] = gspo_parity(root, seed)
    result["mla_cp_work"] = mla_work((2, 4), seq_len=32, k3_seq_len=8192)
    print(write_results(args.out, result))


if __name__ == "__main__":
    main()
