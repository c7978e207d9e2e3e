"""Reference K3: `model.extend` chunk by chunk / token by token (decode) vs one full `model(ids)` forward, fp32.

The figure is the max absolute difference of the logits, over every position of a batch, between the logits
`extend` returns call after call (continuing the state it returned) and the logits of the full forward
(`use_cache=False`), as tests/model/test_model.py::test_extend_splits_match_full_forward measures it (bound 1e-4
there). The model is the test's: the preset with its AttnRes projections and router bias drawn from N(0, 0.5)
(tests/model/conftest.py `_make_tiny`; their initial values are zeros, which would leave those paths unexercised).

Split patterns per length T: one call; the test's cuts (single tokens at the start, around and inside 64-token
chunks); 64-token chunks; random cuts; a prefill then single-token decode steps; token by token throughout.
The AttnRes/router-bias std is per run (0.5 the test's; 0 the preset's own init: at the small preset's width
N(0, 0.5) pseudo-queries make AttnRes's softmax very sharp, which magnifies rounding differences).
Several draws of the token ids per (preset, T), draw d from torch.Generator().manual_seed(d) (draw 0 is the test's ids:
torch.manual_seed(0) then randint): the max and median over draws are reported, with max |logit| for
scale. CPU, fp32. Also records k3.model.count_parameters of each preset.
Writes benchmarks/results/model_consistency.json.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from benchmarks._results import run_header, write_results
from k3.config import K3Config
from k3.model import K3ForCausalLM, count_parameters

TEST_CUTS_150 = {  # tests/model/test_model.py::test_extend_splits_match_full_forward, T = 150
    "test_one_call": [150], "test_single_tokens_at_start": [1, 2, 3, 150],
    "test_around_chunk_boundaries": [63, 64, 65, 129, 150], "test_inside_chunks": [10, 37, 38, 100, 117, 150],
    "test_prefill_then_50_decode": list(range(100, 151)),
}


def make_model(preset: str, seed: int = 0, res_std: float = 0.5) -> K3ForCausalLM:
    """tests/model/conftest.py `_make_tiny(seed, res_std, router_bias=True)` for any preset."""
    torch.manual_seed(seed)
    model = K3ForCausalLM(K3Config.preset(preset)).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("_res_proj.weight") or n.endswith("e_score_correction_bias"):
                p.normal_(0, res_std)
    return model.eval()


def patterns(T: int, decode_tail: int, seed: int) -> dict[str, list[int]]:
    rnd = random.Random(seed)
    cuts = {"one_call": [T], "chunks_64": list(range(64, T, 64)) + [T],
            "random_cuts": sorted(set(rnd.sample(range(1, T), min(T - 1, max(3, T // 40))))) + [T],
            f"prefill_then_{decode_tail}_decode": list(range(T - decode_tail, T + 1)),
            "token_by_token": list(range(1, T + 1))}
    if T == 150:
        cuts = {**TEST_CUTS_150, **cuts}
    return cuts


@torch.no_grad()
def max_diff(model: K3ForCausalLM, ids: torch.Tensor, full: torch.Tensor, cuts: list[int]) -> float:
    state, parts, start = None, [], 0
    for end in cuts:
        logits, state = model.extend(ids[:, start:end], state)
        parts.append(logits)
        start = end
    assert state.seq_len == ids.shape[1]
    return (torch.cat(parts, dim=1) - full).abs().max().item()


def measure(preset: str, T: int, batch: int, draws: int, decode_tail: int, res_std: float = 0.5) -> dict:
    model = make_model(preset, res_std=res_std)
    cfg = model.config
    per_pattern: dict[str, list[float]] = {}
    logit_scale, t0 = 0.0, time.perf_counter()
    for d in range(draws):
        ids = torch.randint(0, cfg.vocab_size, (batch, T), generator=torch.Generator().manual_seed(d))
        with torch.no_grad():
            full = model(ids, use_cache=False).logits
        logit_scale = max(logit_scale, full.abs().max().item())
        for name, cuts in patterns(T, decode_tail, seed=d).items():
            per_pattern.setdefault(name, []).append(max_diff(model, ids, full, cuts))
    rows = {name: {"max_abs_diff_max": max(v), "max_abs_diff_median": statistics.median(v), "per_draw": v}
            for name, v in per_pattern.items()}
    return {"preset": preset, "T": T, "batch": batch, "draws": draws, "dtype": "float32", "res_std": res_std,
            "max_abs_logit": logit_scale, "wall_s": time.perf_counter() - t0,
            "max_abs_diff_all_patterns": max(r["max_abs_diff_max"] for r in rows.values()),
            "max_abs_diff_test_cuts": max((rows[n]["max_abs_diff_max"] for n in TEST_CUTS_150 if n in rows),
                                          default=None),
            "patterns": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="tiny:150:3,tiny:512:1,small:256:1,small:256:1:0",
                    help="preset:T:draws[:res_std] (default res_std 0.5; 0: the preset's own init), comma separated")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--out", default="model_consistency")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    runs = []
    for spec in args.runs.split(","):
        preset, T, draws, *rest = spec.split(":")
        T, res_std = int(T), float(rest[0]) if rest else 0.5
        runs.append(measure(preset, T, batch=2, draws=int(draws), decode_tail=min(50, T // 3), res_std=res_std))
        r = runs[-1]
        print(f"\n{preset} T={T} batch 2, {draws} draws, AttnRes/router-bias init N(0, {res_std:g}), max |logit| "
              f"{r['max_abs_logit']:.2f} ({r['wall_s']:.0f} s)")
        print(f"  {'split pattern':32s} {'max |diff|':>11s} {'median':>11s}")
        for name, v in r["patterns"].items():
            print(f"  {name:32s} {v['max_abs_diff_max']:11.3e} {v['max_abs_diff_median']:11.3e}")
    result = {**run_header("model_consistency", device="cpu"), "dtype": "float32",
              "what": "max |logits(extend split as named) - logits(full forward, use_cache=False)| over all "
                      "positions, batch 2; max and median over draws of random token ids",
              "model_init": "preset + AttnRes projections and router bias ~ N(0, res_std) (tests/model/conftest.py: "
                            "0.5); res_std 0: the preset's own init (those zero)",
              "max_abs_diff_overall": max(r["max_abs_diff_all_patterns"] for r in runs), "runs": runs,
              "param_counts": {p: count_parameters(K3Config.preset(p)) for p in ("tiny", "small", "k3")}}
    print("parameters (total, active):", {p: (c["total"], c["active"]) for p, c in result["param_counts"].items()})
    print(f"\nwrote {write_results(args.out, result)}")


if __name__ == "__main__":
    main()
