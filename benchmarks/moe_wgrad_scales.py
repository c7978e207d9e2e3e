"""What per-expert FP8 scales would cost the MoE wgrad's accuracy (CPU, no kernels; a design question of
kernels/moe/NOTES.md, session 43).

FP8_FULL quantises the wgrad's operands (dY and H for dW2, dG | dU and X for dW1 | dW3) per channel in 128-token
blocks (k3_kernels.moe.naive.naive_quant_token_blocks), so every token block's partial product must be scaled by
s_a[m] * s_b[n] before it is summed: the wgrad kernels' per-block promotion. One scale per channel over all of an
expert's tokens ("expert" below, torchao's jagged per-group scaling for grouped wgrads) would leave a plain FP8
GEMM with the scales in its epilogue. This measures dW = A^T B's relative RMS error against fp64 for both, and
bf16 operands for scale, on rows whose magnitudes spread log-normally (sigma) with and without outlier channels.
Operands are dequantised and multiplied in fp64: the tensor cores' FP8 accumulation is not modelled.

    python -m benchmarks.moe_wgrad_scales   -> benchmarks/results/moe_wgrad_scales.json
"""
from __future__ import annotations

import argparse

import torch

from benchmarks._numerics import rel_rms
from benchmarks._results import run_header, write_results
from k3_kernels.moe.naive import QUANT_BLOCK, naive_dequant_rows, naive_quant_token_blocks


def dequantised(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [n, C] quantised per channel over `block` tokens (the last block zero-padded), back in fp64."""
    (q, s), = naive_quant_token_blocks(x, torch.tensor([0, x.shape[0]]), block)
    return naive_dequant_rows(q, s, block).t()[:x.shape[0]].double()


def errors(tokens: int, channels: int, experts: int, sigma: float, outliers: bool, seed: int = 0) -> dict:
    """Mean over experts of dW's relative RMS error: bf16 operands, FP8 in 128-token blocks, FP8 per expert."""
    g = torch.Generator().manual_seed(seed)
    out = {"bf16": 0.0, "fp8_token_blocks": 0.0, "fp8_per_expert": 0.0}
    for e in range(experts):
        n = tokens + 37 * e  # experts of different sizes, most not a multiple of 128
        a, b = (torch.randn(n, channels, generator=g, dtype=torch.float64)
                * torch.exp(sigma * torch.randn(n, 1, generator=g, dtype=torch.float64)) for _ in range(2))
        if outliers:
            a[:, :4] *= 20
            b[:, :4] *= 20
        ref = a.t() @ b
        whole = -(-n // QUANT_BLOCK) * QUANT_BLOCK
        out["bf16"] += rel_rms(a.bfloat16().double().t() @ b.bfloat16().double(), ref) / experts
        out["fp8_token_blocks"] += rel_rms(dequantised(a, QUANT_BLOCK).t() @ dequantised(b, QUANT_BLOCK), ref) / experts
        out["fp8_per_expert"] += rel_rms(dequantised(a, whole).t() @ dequantised(b, whole), ref) / experts
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=640, help="rows of the first expert (each next one 37 more)")
    ap.add_argument("--channels", type=int, default=256)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--sigmas", default="0,0.5,1,2", help="log-normal spreads of the rows' magnitudes")
    ap.add_argument("--out", default="moe_wgrad_scales")
    args = ap.parse_args(argv)
    result = {**run_header("moe_wgrad_scales", device="cpu"),
              "shapes": {"tokens": args.tokens, "channels": args.channels, "experts": args.experts}, "rows": []}
    for sigma in (float(v) for v in args.sigmas.split(",")):
        for outliers in (False, True):
            row = {"sigma": sigma, "outlier_channels": outliers,
                   **errors(args.tokens, args.channels, args.experts, sigma, outliers)}
            result["rows"].append(row)
            print(", ".join(f"{k} {v:.4f}" if isinstance(v, float) and k != "sigma" else f"{k} {v}"
                            for k, v in row.items()), flush=True)
    print("wrote", write_results(args.out, result))
    return result


if __name__ == "__main__":
    main()
