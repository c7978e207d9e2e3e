"""Batch-invariant matmul (k3_kernels.batch_invariant) vs cuBLAS (`torch.nn.functional.linear`) at K3's projection
widths and decode / verify row counts, bf16, one process on the GPU. Per (projection, rows): medians of
`triton.testing.do_bench` for both, the bytes floor (weight + activations at the measured copy rate), and whether
each is batch invariant there (every row of a 4-row slice equal to the same rows inside the full call). This is
what a bitwise [B, k+1] speculative verify would pay per projection (k3/rollout/spec/NOTES.md). Writes
benchmarks/results/batch_invariant.json (or $OUT/batch_invariant.json when OUT is set).

    python -m benchmarks.batch_invariant            # on the H200
    python -m benchmarks.batch_invariant --sweep    # also every candidate tile configuration (`SWEEP`, `SWEEP_SPLIT`)
    python -m benchmarks.batch_invariant --sweep --cudagraph   # device time: each call replayed in a CUDA graph

`--cudagraph` times with `triton.testing.do_bench_cudagraph`, as the engine's captured decode runs them: plain
`do_bench` times a few-microsecond GEMM together with its host launch cost (the split-K sweep at c2f5366 measured
one configuration at 60 us for 1 row and 14 us for 32 rows: launch-bound, not the kernel).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

from benchmarks._results import run_header, write_results
from k3_kernels.batch_invariant import MatmulConfig, batch_invariant_linear, config_for

# (name, N, K): K3's per-layer projections (config defaults) and the lm_head
PROJECTIONS = [("mla_q_a", 1536, 7168), ("mla_q_b", 96 * 192, 1536), ("mla_kv_a", 576, 7168),
               ("mla_kv_b", 96 * 256, 512), ("attn_o", 7168, 96 * 128), ("kda_qkv_one", 96 * 128, 7168),
               ("moe_latent", 3584, 7168), ("lm_head", 163840, 7168),
               # KDA's low-rank gate and beta projections: 1-4 output tiles a call
               ("kda_f_a", 128, 7168), ("kda_b", 96, 7168), ("kda_f_b", 96 * 128, 128)]
ROWS = (1, 8, 32, 128, 512)
# (block_m, block_n, block_k, warps, stages) candidates for --sweep: one of them per weight shape is the kernel's
# fixed configuration (batch invariance allows a choice by N and K, never by M)
SWEEP = [(64, 128, 64, 4, 4), (64, 64, 128, 4, 4), (64, 64, 64, 4, 6), (64, 32, 128, 4, 4), (16, 64, 128, 4, 4),
         (16, 32, 256, 4, 3), (32, 64, 128, 4, 4), (128, 128, 64, 8, 3)]
# with K split into fixed ranges (6th: split_k): narrow outputs (q_a 1536, kv_a 576, the MoE latent 3584) have 12-112
# output tiles at decode sizes, too few programs to keep the H200's memory busy (measured 5x over the bytes floor)
SWEEP_SPLIT = [(64, 32, 128, 4, 4, 2), (64, 32, 128, 4, 4, 4), (64, 32, 128, 4, 4, 8), (16, 32, 256, 4, 3, 4),
               (64, 64, 128, 4, 4, 4), (64, 128, 64, 4, 4, 2)]


def copy_rate() -> float:
    """The device's copy rate, bytes a second (read + written), for bytes floors."""
    a = torch.empty(2**28, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), return_mode="median")
    return 2 * a.numel() / (ms * 1e-3)


def _invariant(fn, x, w) -> bool:
    full = fn(x, w)
    return all(torch.equal(fn(x[s:s + 4].clone(), w), full[s:s + 4]) for s in (0, max(0, x.shape[0] - 4)))


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("benchmarks.batch_invariant: needs CUDA (the CPU interpreter has no meaningful times)")
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--cudagraph", action="store_true", help="time each call replayed in a CUDA graph")
    a = ap.parse_args()
    bench = ((lambda fn: do_bench_cudagraph(fn, return_mode="median")) if a.cudagraph
             else (lambda fn: do_bench(fn, return_mode="median")))
    torch.manual_seed(0)
    res = run_header("batch_invariant", "cuda", ("triton",))
    res["gpu"] = torch.cuda.get_device_name()
    res["timing"] = "do_bench_cudagraph" if a.cudagraph else "do_bench"
    res["config"] = {name: vars(config_for(torch.device("cuda"), torch.bfloat16, N, K)) for name, N, K in PROJECTIONS}
    rate = copy_rate()
    res["copy_TBps"] = rate / 1e12
    rows = []
    for name, N, K in PROJECTIONS:
        w = (torch.randn(N, K, device="cuda") / K ** 0.5).to(torch.bfloat16)
        for M in ROWS:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            cublas = bench(lambda: F.linear(x, w))
            ours = bench(lambda: batch_invariant_linear(x, w))
            floor_ms = 2 * (N * K + M * K + M * N) / rate * 1e3
            row = {"projection": name, "N": N, "K": K, "rows": M, "cublas_ms": cublas, "ours_ms": ours,
                   "ours_vs_cublas": cublas / ours, "floor_ms": floor_ms,
                   "cublas_invariant": _invariant(F.linear, x, w),
                   "ours_invariant": _invariant(batch_invariant_linear, x, w)}
            if a.sweep:
                row["sweep_ms"] = {str(c): bench(lambda: batch_invariant_linear(x, w, config=MatmulConfig(*c)))
                                   for c in SWEEP + SWEEP_SPLIT}
                row["sweep_split_invariant"] = {
                    str(c): _invariant(lambda a, b: batch_invariant_linear(a, b, config=MatmulConfig(*c)), x, w)
                    for c in SWEEP_SPLIT}
            rows.append(row)
            print(f"{name:>12} M={M:<4} cublas {cublas * 1e3:8.1f} us  ours {ours * 1e3:8.1f} us  floor "
                  f"{floor_ms * 1e3:7.1f} us  invariant {row['cublas_invariant']}/{row['ours_invariant']}",
                  flush=True)
            if a.sweep:
                print("    " + "  ".join(f"{k}:{v * 1e3:.1f}" for k, v in row["sweep_ms"].items()), flush=True)
        del w
    res["rows"] = rows
    out = os.path.join(os.environ["OUT"], "batch_invariant.json") if os.environ.get("OUT") else "batch_invariant"
    print("wrote", write_results(out, res))


if __name__ == "__main__":
    main()
