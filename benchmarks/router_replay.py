"""Router Replay (R3): train/rollout k3 KL with and without replaying the rollout's experts, perturbed tiny MoE.

The setup of tests/rl/test_router_replay.py::test_r3_lowers_train_rollout_mismatch (the test that made the README
claim): the "rollout engine" is the tiny preset (8 experts, top-2) scoring a batch of 16 x 16 tokens (4 prompt
tokens, 12 response) and recording its routing; the "trainer" is the same model with every matrix moved by
`rel` x its std of Gaussian noise (draw = the noise seed), which flips some experts. Both arms score the SAME batch
with the SAME trainer weights through k3.rl.Learner.compute_logprobs, one with router_replay on (the rollout's
experts forced), one off (the trainer routes by itself); k3.rl.mismatch_metrics against the rollout log-probs
gives the k3 KL (per response token), max and mean |Δ log p|. Reported per (rel, draw) with the routing flip
rates (k3.rl.routing_diff), and the KL ratio no-R3 / R3 (min, median, max over draws per rel and overall).
CPU, fp32. Writes benchmarks/results/router_replay.json.
"""
from __future__ import annotations

import argparse
import copy
import statistics

import torch

from benchmarks._results import run_header, write_results
from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.rl import Batch, Learner, LearnerConfig, mismatch_metrics, routing_diff

B, T, PROMPT = 16, 16, 4


def rollout_batch(seed: int = 0, data_seed: int = 3) -> tuple[K3ForCausalLM, Batch]:
    """The rollout model and the batch it scored (log-probs and routing recorded), as the test builds them."""
    torch.manual_seed(seed)
    model = K3ForCausalLM(K3Config.preset("tiny"))
    g = torch.Generator().manual_seed(data_seed)
    tokens = torch.randint(3, model.config.vocab_size, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[:, PROMPT:] = True
    with torch.no_grad():
        out = model(tokens[:, :-1], use_cache=False, return_routed_experts=True)
    lg = out.logits.float()
    lp = torch.cat([torch.zeros(B, 1), lg.gather(-1, tokens[:, 1:, None])[..., 0] - lg.logsumexp(-1)], 1)
    batch = Batch(tokens, mask, lp, torch.linspace(-1, 1, B), routed_experts=out.routed_experts.to(torch.int16))
    return model, batch


def perturbed(model: K3ForCausalLM, rel: float, seed: int) -> K3ForCausalLM:
    """The trainer: every matrix moved by rel * its std of Gaussian noise (the test's `_perturbed`)."""
    p = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in p.parameters():
            if w.dim() >= 2:
                w.add_(torch.randn(w.shape, generator=g) * w.std() * rel)
    return p


def measure(model: K3ForCausalLM, batch: Batch, rel: float, draw: int) -> dict:
    trainer = perturbed(model, rel, draw)
    mask = batch.response_mask
    with torch.no_grad():
        own = trainer(batch.tokens[:, :-1], use_cache=False, return_routed_experts=True).routed_experts
    flips = routing_diff(own, batch.routed_experts[:, : T - 1].long(), mask[:, 1:])
    arms = {}
    for name, replay in (("no_r3", False), ("r3", True)):
        lp = Learner(trainer, LearnerConfig(router_replay=replay)).compute_logprobs(batch)
        arms[name] = mismatch_metrics(lp, batch.rollout_logp, mask)
    no, r3 = arms["no_r3"]["k3_kl"], arms["r3"]["k3_kl"]
    return {"rel": rel, "draw": draw, **flips, "no_r3": arms["no_r3"], "r3": arms["r3"],
            "k3_kl_ratio_no_r3_over_r3": no / r3 if r3 > 0 else None}


def spread(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)} if xs else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rels", default="1e-4,3e-4,1e-3,3e-3,1e-2", help="relative perturbation sizes")
    ap.add_argument("--draws", type=int, default=5, help="noise seeds 1..N per size")
    ap.add_argument("--out", default="router_replay")
    args = ap.parse_args()
    model, batch = rollout_batch()
    cfg = model.config
    rows = [measure(model, batch, float(rel), d) for rel in args.rels.split(",") for d in range(1, args.draws + 1)]
    print(f"R3 on the tiny MoE ({cfg.num_experts} experts, top-{cfg.num_experts_per_token}, "
          f"{len(model.moe_layer_ids)} MoE layers), {int(batch.response_mask.sum())} response tokens")
    print(f"{'rel':>7s} {'draw':>4s} {'flips':>7s} {'tok flips':>9s} | {'k3 KL no R3':>11s} {'k3 KL R3':>9s} "
          f"{'ratio':>7s} | {'max|dlp| no R3':>14s} {'R3':>9s}")
    for r in rows:
        ratio = r["k3_kl_ratio_no_r3_over_r3"]
        print(f"{r['rel']:7.0e} {r['draw']:4d} {r['flip_frac']:7.4f} {r['token_flip_frac']:9.4f} | "
              f"{r['no_r3']['k3_kl']:11.3e} {r['r3']['k3_kl']:9.3e} {ratio if ratio else float('nan'):7.2f} | "
              f"{r['no_r3']['max_abs_dlogp']:14.3e} {r['r3']['max_abs_dlogp']:9.3e}")
    ratios = lambda rs: [r["k3_kl_ratio_no_r3_over_r3"] for r in rs if r["k3_kl_ratio_no_r3_over_r3"]]  # noqa: E731
    per_rel = {}
    for rel in sorted({r["rel"] for r in rows}):
        rs = [r for r in rows if r["rel"] == rel]
        per_rel[f"{rel:g}"] = {"k3_kl_ratio": spread(ratios(rs)), "flip_frac": spread([r["flip_frac"] for r in rs]),
                               "r3_lower_kl_in_draws": sum(r["r3"]["k3_kl"] < r["no_r3"]["k3_kl"] for r in rs),
                               "draws": len(rs)}
        print(f"rel {rel:g}: ratio {per_rel[f'{rel:g}']['k3_kl_ratio']}")
    result = {**run_header("router_replay", device="cpu"), "dtype": "float32",
              "setup": {"preset": "tiny", "num_experts": cfg.num_experts, "top_k": cfg.num_experts_per_token,
                        "moe_layers": len(model.moe_layer_ids), "batch": B, "seq": T, "prompt_tokens": PROMPT,
                        "response_tokens": int(batch.response_mask.sum()), "model_seed": 0, "data_seed": 3,
                        "test": "tests/rl/test_router_replay.py::test_r3_lowers_train_rollout_mismatch (rel 1e-3, "
                                "3e-3; draws 1-3)"},
              "k3_kl_ratio_no_r3_over_r3_all": spread(ratios(rows)),
              "k3_kl_ratio_test_rels_draws_1_3": spread(ratios([r for r in rows if r["rel"] in (1e-3, 3e-3)
                                                                and r["draw"] <= 3])),
              "r3_lower_kl_in": f"{sum(r['r3']['k3_kl'] < r['no_r3']['k3_kl'] for r in rows)}/{len(rows)}",
              "per_rel": per_rel, "rows": rows}
    print(f"all: ratio {result['k3_kl_ratio_no_r3_over_r3_all']}; test's draws: "
          f"{result['k3_kl_ratio_test_rels_draws_1_3']}; R3 lower in {result['r3_lower_kl_in']}")
    print(f"wrote {write_results(args.out, result)}")


if __name__ == "__main__":
    main()
