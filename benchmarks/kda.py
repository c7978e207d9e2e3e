"""KDA chunked prefill/training: fla-core `chunk_kda` vs k3_kernels `chunk_kda` on one GPU, same process.

Protocol of shared/anchors/bench_fla.py: B=1, H=16, K=V=128, bf16 q/k/v/beta, fp32 log-decay
g = 0.5 * logsigmoid(randn), unit-norm k; T in {4K, 16K, 64K, 128K} plus one packed varlen batch, plus `safe_gate`:
16K with K3's safe gate applied in the kernels and a sharp decay (`sharp_safe_gate`; fla-core with `safe_gate=True`).
Forward medians under no_grad, forward+backward medians (`triton.testing.do_bench`, grads reset each call);
backward = difference. Floors: bytes that must move / measured copy bandwidth, and the report's FLOP count
(Kimi Linear Eq. 13, per head 6 T d^2 + 3 T C d + T C^2, backward taken as 2x) / measured bf16 matmul rate.
Before timing, a short sweep at T=16K picks launch settings (warps, stages, V block; recorded in the JSON with
its timings), a profiler pass records device time per kernel, and each size up to 32K checks ours against
fla-core (relative RMS of o and every gradient). Writes benchmarks/results/kda.json (or $OUT/kda.json when OUT
is set) after every row. `--quick`: no sweep, 4K and 16K only (`--sweep` adds it back); `--rows a,b,varlen`: those
rows only (`safe_gate`: the gate row); `--no-breakdown`: skip the profiler pass. (What each dot-precision setting
costs: `kda_precision.py --time`.)
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench

import k3_kernels.kda.chunk as ours_mod

dev = "cuda"
H, D, C = 16, 128, 64


def med(fn, rep=100, grad_to_none=None) -> float:
    return do_bench(fn, warmup=10, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def inputs(T: int, seed: int = 0):
    torch.manual_seed(seed)
    q = torch.randn(1, T, H, D, device=dev, dtype=torch.bfloat16)
    k = F.normalize(torch.randn(1, T, H, D, device=dev), dim=-1).to(torch.bfloat16)
    v = torch.randn(1, T, H, D, device=dev, dtype=torch.bfloat16)
    g = F.logsigmoid(torch.randn(1, T, H, D, device=dev)) * 0.5
    beta = torch.rand(1, T, H, device=dev, dtype=torch.bfloat16)
    return [x.requires_grad_(True) for x in (q, k, v, g, beta)]


def sharp_safe_gate(T: int, device: str = dev) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `safe_gate` row's gate, for the kernels to apply: K3's safe gate (lower bound -5) with the raw input
    f ~ N(0, 1) [1, T, H, D] fp32 (in place of the log-decay), A_log = 0 and dt_bias = 0, so the log-decay is
    -5 sigmoid(f): -2.5 per token on average and every 64-token chunk spans more than 80 (the kernels' hard case:
    our 16-row blocks; fla-core's `safe_gate` path is built for it). K3's own init is milder (dt_bias ~ log U(1e-3,
    1e-1) puts the decay near -5 dt per token)."""
    gen = torch.Generator(device=device).manual_seed(3)
    f = torch.randn(1, T, H, D, device=device, generator=gen)
    return (f.requires_grad_(True), torch.zeros(H, device=device, requires_grad=True),
            torch.zeros(H * D, device=device, requires_grad=True))


def safe_gate_kwargs(A_log: torch.Tensor, dt_bias: torch.Tensor) -> dict:
    """chunk_kda keywords that apply K3's safe gate (lower bound -5) to g in the kernels (ours and fla-core's)."""
    return dict(use_gate_in_kernel=True, lower_bound=-5., A_log=A_log, dt_bias=dt_bias)


def packed_cu_seqlens() -> torch.Tensor:
    """The varlen row's batch: 8 sequences packed into 32K tokens, cut at fixed random points."""
    gen = torch.Generator().manual_seed(1)
    cuts = torch.sort(torch.randperm(32767, generator=gen)[:7] + 1).values
    return torch.cat([torch.tensor([0]), cuts, torch.tensor([32768])]).to(dev)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def floors(T: int, copy_Bps: float, mm_flops: float) -> dict:
    tok = T * H
    fwd_bytes = tok * (2 * D + 2 * D + 2 * D + 4 * D + 2 + 2 * D)
    bwd_bytes = fwd_bytes + tok * (2 * D + 2 * D + 2 * D + 4 * D + 2)  # + do read, grads written
    fwd_flops = H * (6 * T * D * D + 3 * T * C * D + T * C * C)
    return dict(fwd_bytes=fwd_bytes, fwd_floor_ms=max(fwd_bytes / copy_Bps, fwd_flops / mm_flops) * 1e3,
                bwd_bytes=bwd_bytes, bwd_floor_ms=max(bwd_bytes / copy_Bps, 2 * fwd_flops / mm_flops) * 1e3,
                fwd_flops=fwd_flops)


def run_pair(fla_kda, xs, do, cu=None, check=False, rep=100, gate=None):
    """(fla fwd, ours fwd, fla fwd+bwd, ours fwd+bwd) medians in ms, plus errors of ours vs fla if check. `gate`:
    (A_log, dt_bias), the safe gate with lower bound -5 applied in the kernels to g (`sharp_safe_gate`); their gradients
    join the check."""
    q, k, v, g, beta = xs
    kw = {} if cu is None else dict(cu_seqlens=cu, cu_seqlens_cpu=cu.cpu())  # both sides skip the host sync
    fla_kw = kw
    if gate is not None:
        kw = dict(kw, **safe_gate_kwargs(*gate))
        fla_kw = dict(kw, safe_gate=True)
        xs = list(xs) + list(gate)
    res, errs = {}, {}
    outs = {}
    for name, fn, extra in (("fla", fla_kda, fla_kw), ("ours", ours_mod.chunk_kda, kw)):
        with torch.no_grad():
            fn(q, k, v, g, beta, **extra)
            res[name + "_fwd_ms"] = med(lambda: fn(q, k, v, g, beta, **extra), rep=rep)

        def fb():
            o, _ = fn(q, k, v, g, beta, **extra)
            o.backward(do)
        for x in xs:
            x.grad = None
        fb()
        torch.cuda.synchronize()
        if check:
            with torch.no_grad():
                outs[name] = [fn(q, k, v, g, beta, **extra)[0]] + [x.grad.clone() for x in xs]
        res[name + "_fwdbwd_ms"] = med(fb, rep=max(rep // 2, 20), grad_to_none=xs)
    if check:
        for n, a, b in zip(("o", "dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias"), outs["ours"], outs["fla"]):
            errs[n] = rel(a, b)
    for name in ("fla", "ours"):
        res[name + "_bwd_ms"] = res[name + "_fwdbwd_ms"] - res[name + "_fwd_ms"]
    res["speedup_fwd"] = res["fla_fwd_ms"] / res["ours_fwd_ms"]
    res["speedup_bwd"] = res["fla_bwd_ms"] / res["ours_bwd_ms"]
    res["speedup_fwdbwd"] = res["fla_fwdbwd_ms"] / res["ours_fwdbwd_ms"]
    if check:
        res["rel_rms_ours_vs_fla"] = errs
    return res


def sweep(T: int) -> list:
    """Pick launch settings stage by stage (each keeps the best of its candidates): the forward intra kernel by our
    forward, the backward kernels (intra, prep, the prep's K slice `ka`, state pass) by our forward+backward, at
    length T."""
    xs = inputs(T)
    do = torch.randn(1, T, H, D, device=dev, dtype=torch.bfloat16)
    log = []
    def t_fwd():
        with torch.no_grad():
            ours_mod.chunk_kda(*xs)
            return med(lambda: ours_mod.chunk_kda(*xs), rep=50)

    def t_fb():
        def fb():
            ours_mod.chunk_kda(*xs)[0].backward(do)
        fb()
        return med(fb, rep=30, grad_to_none=xs)
    space = [("intra", ("bk", "warps", "stages"), [(32, 4, 2), (32, 4, 3)], t_fwd),
             ("bwd_intra", ("bk", "warps", "stages"), [(32, 4, 3), (32, 4, 2), (64, 8, 2)], t_fb),
             ("bwd_prep", ("bv", "warps", "stages"), [(32, 4, 1), (32, 4, 2), (64, 4, 1), (32, 8, 1), (16, 4, 1)],
              t_fb),
             ("", ("ka",), [(32,), (64,)], t_fb),
             ("bwd_state", ("bv", "warps", "stages"), [(None, 4, 3), (16, 4, 2), (16, 2, 3), (32, 8, 3)], t_fb)]
    for stage, keys, cands, timer in space:
        best = None
        for cand in cands:
            ours_mod.CONFIG.update({"_".join(filter(None, (stage, k))): x for k, x in zip(keys, cand)})
            try:
                t = timer()
            except (OutOfResources, triton.CompilationError) as e:  # e.g. shared memory, dot shape: skip it
                log.append(dict(stage=stage, T=T, **dict(zip(keys, cand)), error=str(e)[:300]))
                print("sweep", log[-1], flush=True)
                continue
            log.append(dict(stage=stage, T=T, **dict(zip(keys, cand)), ms=t))
            print("sweep", log[-1], flush=True)
            if best is None or t < best[0]:
                best = (t, cand)
        ours_mod.CONFIG.update({"_".join(filter(None, (stage, k))): x for k, x in zip(keys, best[1])})
    return log


def breakdown(T: int, kda=None) -> dict:
    """Device time per kernel (ms) in one forward+backward at length T (torch.profiler); ours by default."""
    kda = kda or ours_mod.chunk_kda
    xs = inputs(T)
    do = torch.randn(1, T, H, D, device=dev, dtype=torch.bfloat16)
    def fb():
        for x in xs:  # fresh gradients, as in the timed rows (no accumulation kernels in the table)
            x.grad = None
        kda(*xs)[0].backward(do)
    for _ in range(2):
        fb()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fb()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t:
            out[e.key] = out.get(e.key, 0.) + t / 1e3
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:20])


def main() -> None:
    quick = "--quick" in sys.argv  # no sweep, 4K and 16K only
    do_sweep = not quick or "--sweep" in sys.argv
    from fla import __version__ as fla_version
    from fla.ops.kda import chunk_kda as fla_kda
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "fla_core": fla_version, "shape": dict(B=1, H=H, K=D, V=D, dtype="bf16", g="fp32 0.5*logsigmoid(randn)")}
    x = torch.randn(1 << 29, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    t = med(lambda: y.copy_(x), rep=100)
    copy_Bps = 2 * x.numel() * 2 / (t * 1e-3)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    t = med(lambda: a @ a, rep=100)
    mm_flops = 2 * 8192 ** 3 / (t * 1e-3)
    del x, y, a
    res["copy_TBps"], res["bf16_mm_TFLOPs"] = copy_Bps / 1e12, mm_flops / 1e12
    t0 = time.time()
    res["sweep"] = sweep(16384) if do_sweep else []
    res["config"] = dict(ours_mod.CONFIG)
    print("config", res["config"], f"sweep {time.time() - t0:.0f}s", flush=True)
    if "--no-breakdown" not in sys.argv:
        res["breakdown_T16384_fwdbwd_ms"] = breakdown(16384)
        print("breakdown", res["breakdown_T16384_fwdbwd_ms"], flush=True)
        res["fla_breakdown_T16384_fwdbwd_ms"] = breakdown(16384, fla_kda)
        print("fla breakdown", res["fla_breakdown_T16384_fwdbwd_ms"], flush=True)
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out_dir, exist_ok=True)

    def save() -> None:  # after every row, so a run cut short still leaves its measured rows
        with open(os.path.join(out_dir, "kda.json"), "w") as f:
            json.dump(res, f, indent=1)
    rows = res["chunk_kda"] = []
    cu = packed_cu_seqlens()
    named = {"varlen": 32768, "safe_gate": 16384}  # rows by name -> tokens
    sizes = [4096, 16384] if quick else [4096, 16384, "varlen", 65536, 131072, "safe_gate"]
    if "--rows" in sys.argv:  # e.g. --rows 65536,131072,varlen,safe_gate
        sizes = [x if x in named else int(x) for x in sys.argv[sys.argv.index("--rows") + 1].split(",")]
    for T in sizes:
        varlen, gated = T == "varlen", T == "safe_gate"
        T = named.get(T, T)
        xs = inputs(T)
        gate = None
        if gated:
            xs[3], *gate = sharp_safe_gate(T)
        do = torch.randn(1, T, H, D, device=dev, dtype=torch.bfloat16)
        kind = dict(varlen=cu.tolist()) if varlen else dict(gate="sharp_safe_gate") if gated else {}
        row = dict(T=T, **kind, **run_pair(fla_kda, xs, do, cu=cu if varlen else None, check=T <= 32768,
                                           rep=100 if T <= 32768 else 30, gate=gate), **floors(T, copy_Bps, mm_flops))
        print("kda", row, flush=True)
        rows.append(row)
        save()
        del xs, do
        torch.cuda.empty_cache()
    print(f"\n{'T':>7} {'fla fwd':>8} {'ours':>7} {'x':>5} | {'fla bwd':>8} {'ours':>7} {'x':>5} | "
          f"{'floor f/b ms':>13}")
    for r in rows:
        kind = "v" if "varlen" in r else "g" if "gate" in r else " "
        print(f"{r['T']:>7}{kind}{r['fla_fwd_ms']:>8.3f} {r['ours_fwd_ms']:>7.3f} "
              f"{r['speedup_fwd']:>5.2f} | {r['fla_bwd_ms']:>8.3f} {r['ours_bwd_ms']:>7.3f} {r['speedup_bwd']:>5.2f} | "
              f"{r['fwd_floor_ms']:>6.3f}/{r['bwd_floor_ms']:.3f}")


if __name__ == "__main__":
    main()
