"""KDA numerics: relative RMS error of o, the final state and every gradient against the fp64 recurrent reference,
for ours (the precision settings of `CONFIGS`) and fla-core, all on the same inputs in one process.

Setting of tests/kernels/test_kda.py::test_gpu_bf16_against_reference: bf16 q/k/v/beta, B=2, T=300 (not a
chunk multiple), H=HV=2, K=V=128, initial state, output gradient on o and the final state; two gates: `plain`
(precomputed g = 0.5 logsigmoid(randn)) and `safe` (K3's gate in the kernel: lower_bound -5, A_log = 0,
dt_bias = 0.1 randn). FLA's tolerances: o 5e-3, dq/dk/dv/dh0/ddt_bias 8e-3, dg/dbeta/dA_log 2e-2.
Writes benchmarks/results/kda_precision.json (or $OUT/kda_precision.json when OUT is set).
`--cases plain,safe,safe_fla` (default plain,safe), `--seeds N` (default 2), `--configs default,tf32x3,...` (ours'
precision settings, `CONFIGS`; default all), `--no-fla`, `--time T` (then our forward+backward time at length T under
each setting).
`--smoke`: CPU interpreter, fp32, small shapes, ours only, JSON in the working directory (checks the script).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks._numerics import rel_rms  # noqa: E402
import k3_kernels.kda.chunk as ours_mod  # noqa: E402
from k3_kernels.kda import naive_kda_lowerbound_gate, naive_recurrent_kda  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
DTYPE = torch.float32 if SMOKE else torch.bfloat16
B, T, H, K, V = (1, 100, 1, 32, 32) if SMOKE else (2, 300, 2, 128, 128)
LOWER = -5.0


def inputs(case: str, seed: int) -> dict[str, torch.Tensor]:
    """`plain` / `safe`: our tests' distribution (randn q, unit-norm randn k, randn v; safe: A_log 0, dt_bias
    0.1 randn). `safe_fla`: fla-core's own chunk test (uniform q/k/v with q and k l2-normalised, randn A_log and
    dt_bias), with `scale` 0.1 as there."""
    torch.manual_seed(seed)
    if case == "safe_fla":
        return dict(q=F.normalize(torch.rand(B, T, H, K, device=DEV), dim=-1).to(DTYPE),
                    k=F.normalize(torch.rand(B, T, H, K, device=DEV), dim=-1).to(DTYPE),
                    v=torch.rand(B, T, H, V, device=DEV).to(DTYPE), g=torch.randn(B, T, H, K, device=DEV),
                    beta=torch.randn(B, T, H, device=DEV).sigmoid().to(DTYPE), h0=torch.randn(B, H, K, V, device=DEV),
                    A_log=torch.randn(H, device=DEV), dt_bias=torch.randn(H * K, device=DEV))
    x = dict(q=torch.randn(B, T, H, K, device=DEV).to(DTYPE),
             k=F.normalize(torch.randn(B, T, H, K, device=DEV), dim=-1).to(DTYPE),
             v=torch.randn(B, T, H, V, device=DEV).to(DTYPE),
             g=torch.randn(B, T, H, K, device=DEV) if case == "safe"
             else F.logsigmoid(torch.randn(B, T, H, K, device=DEV)) * 0.5,
             beta=torch.rand(B, T, H, device=DEV).to(DTYPE),
             h0=torch.randn(B, H, K, V, device=DEV))
    if case == "safe":
        x["A_log"] = torch.zeros(H, device=DEV)
        x["dt_bias"] = torch.randn(H * K, device=DEV) * 0.1
    return x


def run(fn, x: dict, do: torch.Tensor, dht: torch.Tensor, **kw) -> tuple[dict, dict]:
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    extra = {n: leaves[n] for n in ("A_log", "dt_bias") if n in leaves}
    o, ht = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], initial_state=leaves["h0"],
               output_final_state=True, **extra, **kw)
    torch.autograd.backward([o, ht], [do.to(o.dtype), dht.to(ht.dtype)])
    return {"o": o, "ht": ht}, {"d" + n: t.grad for n, t in leaves.items()}


def reference(q, k, v, g, beta, initial_state, output_final_state, A_log=None, dt_bias=None, scale=None):
    """fp64 token-by-token recurrence; the safe gate applied in torch when A_log is given."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    if A_log is not None:
        g = naive_kda_lowerbound_gate(g, A_log.double(), dt_bias.double(), LOWER)
    return naive_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state.double(),
                               output_final_state=output_final_state)


# precision settings of ours compared (CONFIG patches): the default (TF32 for fp32 operands of 16-bit inputs),
# 3xTF32 everywhere, and 3xTF32 in one backward kernel only
CONFIGS = {"default": {}, "tf32x3": {"dot_precision": "tf32x3"}, "intra_x3": {"bwd_intra_precision": "tf32x3"},
           "prep_x3": {"bwd_prep_precision": "tf32x3"}}


@contextlib.contextmanager
def patched(patch: dict):
    """ours_mod.CONFIG with `patch` applied for the duration, restored after (also on error)."""
    saved = dict(ours_mod.CONFIG)
    ours_mod.CONFIG.update(patch)
    try:
        yield
    finally:
        ours_mod.CONFIG.clear()
        ours_mod.CONFIG.update(saved)


def main() -> None:
    fla_kda = None
    configs = sys.argv[sys.argv.index("--configs") + 1].split(",") if "--configs" in sys.argv else list(CONFIGS)
    if not SMOKE and "--no-fla" not in sys.argv:
        from fla.ops.kda import chunk_kda as fla_kda
    res = {"shape": dict(B=B, T=T, H=H, K=K, V=V, dtype=str(DTYPE)), "rows": []}
    out_dir = os.environ.get("OUT") or (os.path.join(os.path.dirname(__file__), "results") if not SMOKE else ".")
    os.makedirs(out_dir, exist_ok=True)
    cases = sys.argv[sys.argv.index("--cases") + 1].split(",") if "--cases" in sys.argv else ["plain", "safe"]
    seeds = range(int(sys.argv[sys.argv.index("--seeds") + 1])) if "--seeds" in sys.argv else range(2)
    for case in cases:
        for seed in seeds:
            x = inputs(case, seed)
            do = torch.randn(B, T, H, V, device=DEV)
            dht = torch.randn(B, H, K, V, device=DEV)
            scale = dict(scale=0.1) if case == "safe_fla" else {}
            ref, dref = run(reference, {n: t.double() for n, t in x.items()}, do.double(), dht.double(), **scale)
            gate = dict(use_gate_in_kernel=True, lower_bound=LOWER, **scale) if case != "plain" else {}
            impls = [(f"ours[{c}]", ours_mod.chunk_kda, gate, CONFIGS[c]) for c in configs]
            if fla_kda is not None:
                impls.insert(1, ("fla", fla_kda, dict(gate, safe_gate=True) if case != "plain" else {}, {}))
            for name, fn, kw, patch in impls:
                with patched(patch):
                    outs, grads = run(fn, x, do, dht, **kw)
                row = dict(case=case, seed=seed, impl=name, o=rel_rms(outs["o"], ref["o"]),
                           ht=rel_rms(outs["ht"], ref["ht"]),
                           **{n: rel_rms(grads[n], dref[n]) for n in dref if grads.get(n) is not None})
                res["rows"].append(row)
                print(json.dumps({k: (f"{v:.2e}" if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
            with open(os.path.join(out_dir, "kda_precision.json"), "w") as f:
                json.dump(res, f, indent=1)
    if "--time" in sys.argv:  # what each setting costs: our forward+backward at B=1, H=16, K=V=128, length T
        from triton.testing import do_bench

        from benchmarks.kda import inputs as timing_inputs  # the speed benchmark's inputs (repo root on the path)
        Tt = int(sys.argv[sys.argv.index("--time") + 1])
        xs = timing_inputs(Tt)
        do = torch.randn(1, Tt, 16, V, device=DEV, dtype=DTYPE)
        res[f"fwdbwd_ms_T{Tt}"] = {}
        for c in configs:
            with patched(CONFIGS[c]):
                ms = do_bench(lambda: ours_mod.chunk_kda(*xs)[0].backward(do), warmup=5, rep=100, grad_to_none=xs,
                              return_mode="median")
            res[f"fwdbwd_ms_T{Tt}"][c] = ms
            print(json.dumps({"T": Tt, "config": c, "fwdbwd_ms": round(ms, 4)}), flush=True)
        with open(os.path.join(out_dir, "kda_precision.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
