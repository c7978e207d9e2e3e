"""The trained draft head's linears at K3's width (fuse 21504 -> 7168, mix 14336 -> 7168, up 7168 -> 14336,
down 14336 -> 7168), a few rows: bf16 weights through cuBLAS (F.linear, what the head runs with
`drafter_dtype="target"`) against e4m3 weights through k3_kernels.fp8_linear (`drafter_dtype="float8"`: its
default tile, and the rows-major layout), in one process; medians of triton.testing.do_bench_cudagraph (a launch's
host time out of the figure), the bytes floor at the measured copy rate, and the FP8 output's error against fp32.
`--sweep`: every tile of TILES at 8 rows over the four matrices, ranked by a chain of 3's linears (fuse once, mix /
up / down three times). GPU only.

    . benchmarks/device_env.sh && python3 -m benchmarks.fp8_linear --sweep --out $OUT/fp8_linear.json
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks._numerics import rel_rms
from benchmarks._results import run_header, write_results

SHAPES = {"fuse": (7168, 21504), "mix": (7168, 14336), "up": (14336, 7168), "down": (7168, 14336)}
CHAIN = {"fuse": 1, "mix": 3, "up": 3, "down": 3}   # matrix -> times a chain of 3 draft steps runs it


def tiles():
    from k3_kernels.fp8_linear.gemv import Fp8LinearTile
    out = [Fp8LinearTile("rows_major", n, k, 4, 3) for n, k in ((32, 256), (32, 512), (16, 512))]
    out += [Fp8LinearTile("swapped", n, k, 4 if n == 64 else 8, st, split, f16) for n in (64, 128) for k in (128, 256)
            for st in (3, 5) for split in (1, 2, 4) for f16 in (False, True)]
    return out


def main() -> None:
    from dataclasses import asdict

    from triton.testing import do_bench_cudagraph

    from benchmarks.batch_invariant import copy_rate
    from k3_kernels.fp8_linear import fp8_weight_linear, quantize_weight_rows
    from k3_kernels.fp8_linear.gemv import DEFAULT_TILE, Fp8LinearTile
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--out", default="fp8_linear")
    ap.add_argument("--sweep", action="store_true", help="also every tile of tiles() at 8 rows")
    a = ap.parse_args()
    torch.manual_seed(0)
    rate = copy_rate() / 1e9   # GB/s
    rows_major = Fp8LinearTile("rows_major", 32, 512, 4, 3)   # the best rows-major tile at 54f0209
    points, cases = [], {}
    for name, (N, K) in SHAPES.items():
        w = (torch.randn(N, K, device="cuda") / K ** 0.5).bfloat16()
        q, scale = quantize_weight_rows(w.float())
        for M in [int(r) for r in a.rows.split(",")]:
            x = torch.randn(M, K, device="cuda").bfloat16()
            cases[name, M] = (x, q, scale)
            bf16_ms = do_bench_cudagraph(lambda: F.linear(x, w), return_mode="median")
            fp8_ms = do_bench_cudagraph(lambda: fp8_weight_linear(x, q, scale), return_mode="median")
            rm_ms = do_bench_cudagraph(lambda: fp8_weight_linear(x, q, scale, rows_major), return_mode="median")
            ref = F.linear(x.float(), w.float())
            err = rel_rms(fp8_weight_linear(x, q, scale), ref)
            points.append({"matrix": name, "N": N, "K": K, "rows": M, "bf16_cublas_ms": bf16_ms, "fp8_ms": fp8_ms,
                           "fp8_rows_major_ms": rm_ms, "speedup": bf16_ms / fp8_ms,
                           "bf16_floor_ms": N * K * 2 / rate / 1e6, "fp8_floor_ms": N * K / rate / 1e6,
                           "fp8_rel_rms_vs_fp32": err})
            print(points[-1], flush=True)
    chain = {}
    for M in [int(r) for r in a.rows.split(",")]:
        rows = {p["matrix"]: p for p in points if p["rows"] == M}
        for kind in ("bf16_cublas_ms", "fp8_ms", "fp8_rows_major_ms", "bf16_floor_ms", "fp8_floor_ms"):
            chain.setdefault(str(M), {})[kind] = sum(n * rows[m][kind] for m, n in CHAIN.items())
    print("chain of 3:", chain, flush=True)
    swept = []
    if a.sweep:
        for tile in tiles():
            entry = {**asdict(tile)}
            try:
                for name in SHAPES:
                    x, q, scale = cases[name, 8]
                    entry[name] = do_bench_cudagraph(lambda: fp8_weight_linear(x, q, scale, tile),
                                                     return_mode="median")
                entry["chain_of_3_ms"] = sum(n * entry[m] for m, n in CHAIN.items())
            except Exception as e:   # noqa: BLE001 -- Triton's OutOfResources and kin: the tile does not fit
                entry["error"] = f"{type(e).__name__}: {str(e)[:120]}"
            swept.append(entry)
            print(entry, flush=True)
        swept.sort(key=lambda t: t.get("chain_of_3_ms", float("inf")))
        print("best tiles:", swept[:3], flush=True)
    write_results(a.out, {**run_header("fp8_linear", device="cuda", packages=("triton",)), "copy_gbps": rate,
                          "default_tile": asdict(DEFAULT_TILE), "rows_major_tile": asdict(rows_major),
                          "points": points, "chain_of_3_linears_ms": chain, "sweep_rows_8": swept})


if __name__ == "__main__":
    main()
