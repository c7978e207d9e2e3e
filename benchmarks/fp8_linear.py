"""The trained draft head's linears at K3's width (fuse 21504 -> 7168, mix 14336 -> 7168, up 7168 -> 14336,
down 14336 -> 7168), a few rows: bf16 weights through cuBLAS (F.linear, what the head runs with
`drafter_dtype="target"`) against e4m3 weights through k3_kernels.fp8_linear (`drafter_dtype="float8"`), in one
process; medians of triton.testing.do_bench_cudagraph (a launch's host time out of the figure), the
bytes floor at the measured copy rate, and the FP8 output's error against bf16. GPU only.

    . benchmarks/device_env.sh && python3 -m benchmarks.fp8_linear --out $OUT/fp8_linear.json
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks._results import run_header, write_results

SHAPES = {"fuse": (7168, 21504), "mix": (7168, 14336), "up": (14336, 7168), "down": (7168, 14336)}


TILES = [dict(block_n=n, block_k=k, num_warps=w, num_stages=st) for n in (16, 32, 64) for k in (128, 256, 512)
         for w in (4, 8) for st in (3, 5) if n * k <= 16384]


def sweep(run, bench) -> list[dict]:
    """Every tile of TILES timed on `run(**tile)`, fastest first (tiles that do not fit are left out)."""
    timed = []
    for tile in TILES:
        try:
            timed.append({**tile, "ms": bench(lambda: run(**tile), return_mode="median")})
        except Exception as e:   # noqa: BLE001 -- Triton's OutOfResources and kin: the tile does not fit
            timed.append({**tile, "error": type(e).__name__})
    return sorted(timed, key=lambda t: t.get("ms", float("inf")))


def main() -> None:
    from triton.testing import do_bench_cudagraph

    from benchmarks.batch_invariant import copy_rate
    from k3_kernels.fp8_linear import fp8_weight_linear, quantize_weight_rows
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--out", default="fp8_linear")
    ap.add_argument("--sweep", action="store_true", help="also the kernel's tiles at every shape, at 8 rows")
    a = ap.parse_args()
    torch.manual_seed(0)
    rate = copy_rate() / 1e9   # GB/s
    points = []
    for name, (N, K) in SHAPES.items():
        w = (torch.randn(N, K, device="cuda") / K ** 0.5).bfloat16()
        q, scale = quantize_weight_rows(w.float())
        for M in [int(r) for r in a.rows.split(",")]:
            x = torch.randn(M, K, device="cuda").bfloat16()
            bf16_ms = do_bench_cudagraph(lambda: F.linear(x, w), return_mode="median")
            fp8_ms = do_bench_cudagraph(lambda: fp8_weight_linear(x, q, scale), return_mode="median")
            ref = F.linear(x.float(), w.float())
            err = ((fp8_weight_linear(x, q, scale).float() - ref).norm() / ref.norm()).item()
            points.append({"matrix": name, "N": N, "K": K, "rows": M, "bf16_cublas_ms": bf16_ms, "fp8_ms": fp8_ms,
                           "speedup": bf16_ms / fp8_ms, "bf16_floor_ms": N * K * 2 / rate / 1e6,
                           "fp8_floor_ms": N * K / rate / 1e6, "fp8_rel_rms_vs_fp32": err})
            print(points[-1], flush=True)
            if a.sweep and M == 8:
                points[-1]["tiles"] = sweep(lambda **tile: fp8_weight_linear(x, q, scale, **tile), do_bench_cudagraph)
                print("  best tile", points[-1]["tiles"][0], flush=True)
    chain = {}
    for M in [int(r) for r in a.rows.split(",")]:   # a chain of 3: fuse once, mix / up / down three times
        rows = {p["matrix"]: p for p in points if p["rows"] == M}
        for kind in ("bf16_cublas_ms", "fp8_ms"):
            chain.setdefault(str(M), {})[kind] = rows["fuse"][kind] + 3 * sum(rows[m][kind] for m in ("mix", "up",
                                                                                                     "down"))
    write_results(a.out, {**run_header("fp8_linear", device="cuda", packages=("triton",)), "copy_gbps": rate,
                          "points": points, "chain_of_3_linears_ms": chain})


if __name__ == "__main__":
    main()
