"""KDA's per-token inputs at K3's width (96 heads x 128, conv 4, bf16, safe gate): the plain-torch composition
(`naive_kda_step_inputs`: cuDNN conv, SiLU, L2 norm, gate, sigmoid, ~50 launches) against the one-launch Triton
kernel (`fused_kda_step_inputs`), in one process, at the shapes inference runs it: a decode step (1 token), a
chain-3 verify (4 tokens), the speculative commit's rebuild (4 tokens, no q, windows rolled per row) and a prefill.
Medians of triton.testing.do_bench_cudagraph (the launches' device-side cost, as the engine's captured graphs pay
it) and of do_bench (eager: the host's launch cost too); the outputs' error against the composition. GPU only.

    . benchmarks/device_env.sh && python3 -m benchmarks.kda_step_inputs --out $OUT/kda_step_inputs.json
"""
from __future__ import annotations

import argparse

import torch

from benchmarks._results import run_header, write_results

H, K, W, LOWER_BOUND = 96, 128, 4, -5.0
CASES = [("decode", 1, 1, True, False), ("decode", 8, 1, True, False), ("decode", 32, 1, True, False),
         ("verify_chain3", 8, 4, True, False), ("commit_chain3", 8, 4, False, True), ("prefill", 1, 4096, True, False)]


def inputs(B: int, T: int) -> dict:
    C = H * K
    dt = torch.exp(torch.empty(C, device="cuda").uniform_(-6.9, -2.3))
    x = torch.randn(B, T, 3, C, device="cuda").bfloat16()
    return dict(xq=x[:, :, 0], xk=x[:, :, 1], xv=x[:, :, 2], f=torch.randn(B, T, C, device="cuda").bfloat16(),
                b=torch.randn(B, T, H, device="cuda").bfloat16(), windows=torch.randn(B, 3, C, W - 1, device="cuda"),
                conv_weights=tuple((torch.randn(C, 1, W, device="cuda") / W).bfloat16() for _ in range(3)),
                A_log=torch.empty(H, device="cuda").uniform_(1, 16).log().bfloat16(),
                dt_bias=(dt + torch.log(-torch.expm1(-dt))).bfloat16())


def main() -> None:
    from triton.testing import do_bench, do_bench_cudagraph

    from k3_kernels.kda import naive_kda_step_inputs
    from k3_kernels.kda.step_inputs import fused_kda_step_inputs
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="kda_step_inputs")
    a = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    with torch.inference_mode():
        for name, B, T, with_q, roll in CASES:
            case = inputs(B, T)
            kw = dict(lower_bound=LOWER_BOUND, with_q=with_q,
                      roll=torch.randint(0, T + 1, (B,), device="cuda") if roll else None)
            torch_fn = lambda: naive_kda_step_inputs(**case, **kw)   # noqa: E731
            ours_fn = lambda: fused_kda_step_inputs(**case, **kw)   # noqa: E731
            ref, got = torch_fn(), ours_fn()
            err = {n: ((g.double() - r.double()).norm() / r.double().norm()).item()
                   for n, r, g in zip(("q", "k", "v", "g", "beta"), ref, got) if r is not None}
            row = {"case": name, "B": B, "T": T, "with_q": with_q, "roll": roll,
                   "windows_equal": bool(torch.equal(ref[5], got[5])), "rel_err": err}
            for label, fn in (("torch", torch_fn), ("ours", ours_fn)):
                row[f"{label}_graph_ms"] = do_bench_cudagraph(fn, return_mode="median")
                row[f"{label}_eager_ms"] = do_bench(fn, return_mode="median")
            row["x_graph"] = row["torch_graph_ms"] / row["ours_graph_ms"]
            row["x_eager"] = row["torch_eager_ms"] / row["ours_eager_ms"]
            print(row, flush=True)
            rows.append(row)
    header = run_header("kda_step_inputs", device=torch.cuda.get_device_name(), packages=("triton",))
    path = write_results(a.out, {**header,
                                 "dims": {"heads": H, "head_dim": K, "conv": W, "lower_bound": LOWER_BOUND},
                                 "rows": rows})
    print("wrote", path)


if __name__ == "__main__":
    main()
