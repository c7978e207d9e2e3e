"""KDA on one GPU, fla-core 0.6.0 and k3_kernels in the same process: chunked prefill/training (`chunk_kda`) and
decode (`fused_recurrent_kda`).

chunk_kda rows (`ROWS`, named `<length>_<gate>_H<heads>`): B=1, K=V=128, bf16 q/k/v/beta, unit-norm k, heads 16 or 96
(K3's), length 16K / 64K / 128K or `varlen` (8 sequences packed into 32K tokens, cut at fixed random points), and
three gates: `precomputed` (fla's benchmark protocol: g = 0.5 logsigmoid(randn) fp32, passed as the log-decay);
`k3init` (K3's safe gate applied in the kernels, lower bound -5, with K3's init: A_log = log U(1, 16),
dt ~ logU(1e-3, 1e-1), dt_bias = softplus^-1(dt) full rank [H*K], raw f ~ N(0, 1): the protocol of
shared/anchors/bench_kda_k3gate.py); `sharp` (the same gate with A_log = dt_bias = 0: -2.5 per token on average,
every chunk spans more than 80). fla-core takes `safe_gate=True` on the gated rows. Forward medians under no_grad,
forward+backward medians (`triton.testing.do_bench`, grads reset each call); backward = difference; relative RMS of
o and every gradient (dA_log and ddt_bias included) of ours vs fla-core up to 32K tokens.
`--gate-ab`: our forward+backward at 16K (k3init, H16) with the gate's backward as gate.py's Triton pass vs torch
autograd over the reference gate (CONFIG gate_bwd), same process. `--decode`: fused_recurrent_kda with K3's safe
gate in the kernel, initial state in and final state out, at batch 1 / 32 / 256 and 1 / 4 tokens (verification),
H = 16 and 96. `--breakdown [ROW,...]`: device time per kernel in one forward+backward of each named row (default
16K_k3init_H16), ours and fla-core's (`breakdown_<row>_fwdbwd_ms`, `fla_breakdown_<row>_fwdbwd_ms`).
`--rows a,b,...` picks rows (default: all, in `ROWS` order); `--budget S`: start no row after S seconds;
`--merge FILE`: keep FILE's rows that this run does not measure and its other entries. Writes
benchmarks/results/kda.json (or $OUT/kda.json) with benchmarks/_results.py's header after every row.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from unittest import mock

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import k3_kernels.kda.chunk as ours_mod
from benchmarks._numerics import rel_rms as rel
from benchmarks._results import run_header, write_results

dev = "cuda"
H, D, C = 16, 128, 64
LENGTHS = {"16K": 16384, "64K": 65536, "128K": 131072, "varlen": 32768}
GATES = ("precomputed", "k3init", "sharp")
ROWS = [f"{n}_{g}_H{h}" for h in (16, 96) for n in LENGTHS for g in GATES]


def med(fn, rep=100, grad_to_none=None) -> float:
    return do_bench(fn, warmup=10, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def inputs(T: int, seed: int = 0, heads: int = H):
    """q, k, v, g (0.5 logsigmoid(randn): the precomputed gate), beta for B=1 and `heads` heads, requiring grad."""
    torch.manual_seed(seed)
    q = torch.randn(1, T, heads, D, device=dev, dtype=torch.bfloat16)
    k = F.normalize(torch.randn(1, T, heads, D, device=dev), dim=-1).to(torch.bfloat16)
    v = torch.randn(1, T, heads, D, device=dev, dtype=torch.bfloat16)
    g = F.logsigmoid(torch.randn(1, T, heads, D, device=dev)) * 0.5
    beta = torch.rand(1, T, heads, device=dev, dtype=torch.bfloat16)
    return [x.requires_grad_(True) for x in (q, k, v, g, beta)]


def sharp_safe_gate(T: int, device: str = dev, heads: int = H) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `sharp` gate, for the kernels to apply: K3's safe gate (lower bound -5) with the raw input
    f ~ N(0, 1) [1, T, heads, D] fp32 (in place of the log-decay), A_log = 0 and dt_bias = 0, so the log-decay is
    -5 sigmoid(f): -2.5 per token on average and every 64-token chunk spans more than 80 (the kernels' hard case:
    our 16-row blocks; fla-core's `safe_gate` path is built for it)."""
    gen = torch.Generator(device=device).manual_seed(3)
    f = torch.randn(1, T, heads, D, device=device, generator=gen)
    return (f.requires_grad_(True), torch.zeros(heads, device=device, requires_grad=True),
            torch.zeros(heads * D, device=device, requires_grad=True))


def k3_init_gate(T: int, device: str = dev, heads: int = H) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `k3init` gate: raw f ~ N(0, 1), A_log = log U(1, 16) per head, dt_bias = softplus^-1(dt) with
    dt ~ logU(1e-3, 1e-1) per channel (K3's init; its chunks take the whole-chunk paths)."""
    gen = torch.Generator(device=device).manual_seed(4)
    f = torch.randn(1, T, heads, D, device=device, generator=gen)
    A_log = torch.log(torch.empty(heads, device=device).uniform_(1, 16, generator=gen))
    dt = torch.exp(torch.empty(heads * D, device=device).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    return tuple(x.requires_grad_(True) for x in (f, A_log, dt_bias))


def safe_gate_kwargs(A_log: torch.Tensor, dt_bias: torch.Tensor) -> dict:
    """chunk_kda keywords that apply K3's safe gate (lower bound -5) to g in the kernels (ours and fla-core's)."""
    return dict(use_gate_in_kernel=True, lower_bound=-5., A_log=A_log, dt_bias=dt_bias)


def packed_cu_seqlens() -> torch.Tensor:
    """The varlen row's batch: 8 sequences packed into 32K tokens, cut at fixed random points."""
    gen = torch.Generator().manual_seed(1)
    cuts = torch.sort(torch.randperm(32767, generator=gen)[:7] + 1).values
    return torch.cat([torch.tensor([0]), cuts, torch.tensor([32768])]).to(dev)


def floors(T: int, copy_Bps: float, mm_flops: float, heads: int = H) -> dict:
    tok = T * heads
    fwd_bytes = tok * (2 * D + 2 * D + 2 * D + 4 * D + 2 + 2 * D)
    bwd_bytes = fwd_bytes + tok * (2 * D + 2 * D + 2 * D + 4 * D + 2)  # + do read, grads written
    fwd_flops = heads * (6 * T * D * D + 3 * T * C * D + T * C * C)
    return dict(fwd_floor_ms=max(fwd_bytes / copy_Bps, fwd_flops / mm_flops) * 1e3,
                bwd_floor_ms=max(bwd_bytes / copy_Bps, 2 * fwd_flops / mm_flops) * 1e3)


def row_kwargs(cu: torch.Tensor | None, gate: tuple | None) -> dict:
    """chunk_kda keywords of a row: a packed batch's cu_seqlens with its host copy (so neither side syncs the
    device per call) and, with gate = (A_log, dt_bias), K3's safe gate applied in the kernels."""
    kw = {} if cu is None else dict(cu_seqlens=cu, cu_seqlens_cpu=cu.cpu())
    return kw if gate is None else dict(kw, **safe_gate_kwargs(*gate))


def run_pair(fla_kda, xs, do, cu=None, check=False, rep=100, gate=None):
    """(fla fwd, ours fwd, fla fwd+bwd, ours fwd+bwd) medians in ms, plus errors of ours vs fla if check. `gate`:
    (A_log, dt_bias), the safe gate with lower bound -5 applied in the kernels to g (`sharp_safe_gate`); their gradients
    join the check."""
    q, k, v, g, beta = xs
    kw = row_kwargs(cu, gate)
    fla_kw = kw
    if gate is not None:
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


def row_inputs(name: str) -> tuple[list, torch.Tensor, torch.Tensor | None, tuple | None, int, int]:
    """(q, k, v, g, beta leaves; upstream do; cu_seqlens or None; (A_log, dt_bias) or None; T; heads) of a row."""
    length, gate, heads = name.split("_")
    T, heads = LENGTHS[length], int(heads[1:])
    xs = inputs(T, heads=heads)
    params = None
    if gate != "precomputed":
        xs[3], *params = (k3_init_gate if gate == "k3init" else sharp_safe_gate)(T, heads=heads)
    do = torch.randn(1, T, heads, D, device=dev, dtype=torch.bfloat16)
    return xs, do, packed_cu_seqlens() if length == "varlen" else None, params, T, heads


def breakdown(kda=None, row: str = "16K_k3init_H16") -> dict:
    """Device time per kernel (ms) in one forward+backward of a gated row (torch.profiler); ours by default."""
    kda = kda or ours_mod.chunk_kda
    xs, do, _, params, _, _ = row_inputs(row)
    leaves = xs + list(params)
    kw = safe_gate_kwargs(*params)
    if kda is not ours_mod.chunk_kda:
        kw["safe_gate"] = True

    def fb():
        for x in leaves:  # fresh gradients, as in the timed rows (no accumulation kernels in the table)
            x.grad = None
        kda(*xs, **kw)[0].backward(do)
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
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:25])


def gate_ab() -> dict:
    """Our 16K k3init H16 forward+backward with the gate's backward by gate.py's pass and by torch autograd."""
    xs, do, _, params, _, _ = row_inputs("16K_k3init_H16")
    leaves, kw = xs + list(params), safe_gate_kwargs(*params)
    out = {}
    for how in ("torch", "triton", "torch", "triton"):  # A B A B
        ours_mod.CONFIG["gate_bwd"] = how

        def fb():
            ours_mod.chunk_kda(*xs, **kw)[0].backward(do)
        fb()
        out.setdefault(how + "_fwdbwd_ms", []).append(med(fb, rep=50, grad_to_none=leaves))
    ours_mod.CONFIG["gate_bwd"] = "triton"
    return {k: sorted(v)[0] for k, v in out.items()} | {"runs": out}


DECODE_STAGES_AB = (1, 2, 3)


def decode_rows(fla_recurrent) -> list:
    """fused_recurrent_kda, ours vs fla-core, K3's safe gate in the kernel (k3init parameters), bf16 q/k/v/beta, fp32
    raw gate and state [B, HV, K, V] in, final state out."""
    from k3_kernels.kda import fused_recurrent as recurrent_mod
    from k3_kernels.kda import fused_recurrent_kda
    rows = []
    for heads in (16, 96):
        for B in (1, 32, 256):
            for T in (1, 4):
                torch.manual_seed(5)
                q = torch.randn(B, T, heads, D, device=dev, dtype=torch.bfloat16)
                k = F.normalize(torch.randn(B, T, heads, D, device=dev), dim=-1).to(torch.bfloat16)
                v = torch.randn(B, T, heads, D, device=dev, dtype=torch.bfloat16)
                beta = torch.rand(B, T, heads, device=dev, dtype=torch.bfloat16)
                f, A_log, dt_bias = (x.detach() for x in k3_init_gate(T * B, heads=heads))
                f = f.view(B, T, heads, D)
                h0 = torch.randn(B, heads, D, D, device=dev)
                kw = dict(A_log=A_log, dt_bias=dt_bias, initial_state=h0, output_final_state=True,
                          use_gate_in_kernel=True, lower_bound=-5.)
                row = dict(B=B, T=T, heads=heads)
                outs = {}
                for name, fn in (("fla", fla_recurrent), ("ours", fused_recurrent_kda)):
                    outs[name] = fn(q, k, v, f, beta, **kw)
                    row[name + "_ms"] = med(lambda: fn(q, k, v, f, beta, **kw), rep=50)
                row["speedup"] = row["fla_ms"] / row["ours_ms"]
                # our launch settings A/B'd in the same process: each variant's time and whether it gives the
                # default's bits (the token loop's pipelining depth; q / k prefetched by hand, flipped)
                variants = [(f"ours_stages{n}", "DECODE_STAGES", n) for n in DECODE_STAGES_AB]
                variants.append(("ours_other_prefetch", "DECODE_PREFETCH_QK", not recurrent_mod.DECODE_PREFETCH_QK))
                for label, setting, value in variants:
                    with mock.patch.object(recurrent_mod, setting, value):
                        o_s, ht_s = fused_recurrent_kda(q, k, v, f, beta, **kw)
                        row[f"{label}_ms"] = med(lambda: fused_recurrent_kda(q, k, v, f, beta, **kw), rep=50)
                    row[f"{label}_setting"] = value
                    row[f"{label}_same_bits"] = bool(torch.equal(o_s, outs["ours"][0])
                                                     and torch.equal(ht_s, outs["ours"][1]))
                row["rel_rms_ours_vs_fla"] = dict(o=rel(outs["ours"][0], outs["fla"][0]),
                                                  ht=rel(outs["ours"][1], outs["fla"][1]))
                print("decode", row, flush=True)
                rows.append(row)
    return rows


def device_rates() -> tuple[float, float]:
    """(bf16 copy bytes/s, bf16 8192^3 matmul FLOP/s) measured now, for the floors."""
    x = torch.randn(1 << 29, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    copy_Bps = 2 * x.numel() * 2 / (med(lambda: y.copy_(x), rep=100) * 1e-3)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    return copy_Bps, 2 * 8192 ** 3 / (med(lambda: a @ a, rep=100) * 1e-3)


def breakdown_rows(argv: list[str]) -> list[str]:
    """The rows `--breakdown` names (its optional value: comma-separated ROWS; none given: 16K_k3init_H16), checked
    before any GPU work."""
    if "--breakdown" not in argv:
        return []
    i = argv.index("--breakdown")
    value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else "16K_k3init_H16"
    rows = value.split(",")
    bad = [r for r in rows if r not in ROWS or r.startswith("varlen") or "_precomputed_" in r]
    if bad:
        raise SystemExit(f"--breakdown: {bad} not among the fixed-length gated rows (k3init, sharp) of {ROWS}")
    return rows


def _arg(flag: str, default=None):
    return sys.argv[sys.argv.index(flag) + 1] if flag in sys.argv else default


def main() -> None:
    from fla.ops.kda import chunk_kda as fla_kda
    from fla.ops.kda import fused_recurrent_kda as fla_recurrent
    start = time.time()
    breakdowns = breakdown_rows(sys.argv)
    budget = float(_arg("--budget", "inf"))
    res = {**run_header("kda", torch.cuda.get_device_name(), ("triton", "fla-core")),
           "kernels_commit": os.environ.get("K3_KERNELS_COMMIT"),
           "shape": dict(B=1, K=D, V=D, dtype="bf16 q/k/v/beta, fp32 g", heads=[16, 96])}
    copy_Bps, mm_flops = device_rates()
    res["copy_TBps"], res["bf16_mm_TFLOPs"] = copy_Bps / 1e12, mm_flops / 1e12
    res["config"] = dict(ours_mod.CONFIG)
    merged = _arg("--merge")
    old = json.load(open(merged)) if merged and os.path.exists(merged) else {}
    out_path = os.path.join(os.environ["OUT"], "kda.json") if os.environ.get("OUT") else "kda"

    def save() -> None:  # after every row, so a run cut short still leaves its measured rows
        write_results(out_path, res)
    if "--gate-ab" in sys.argv:
        res["gate_bwd_ab_16K_k3init_H16"] = gate_ab()
        print("gate_ab", res["gate_bwd_ab_16K_k3init_H16"], flush=True)
        save()
    for row in breakdowns:
        res[f"breakdown_{row}_fwdbwd_ms"] = breakdown(row=row)
        res[f"fla_breakdown_{row}_fwdbwd_ms"] = breakdown(fla_kda, row=row)
        print("breakdown", row, res[f"breakdown_{row}_fwdbwd_ms"], res[f"fla_breakdown_{row}_fwdbwd_ms"], flush=True)
        save()
    if "--decode" in sys.argv:
        res["fused_recurrent_kda"] = decode_rows(fla_recurrent)
        res["fused_recurrent_kda_device"] = res["device"]
        save()
    elif "fused_recurrent_kda" in old:
        res["fused_recurrent_kda"] = old["fused_recurrent_kda"]
        res["fused_recurrent_kda_device"] = old.get("fused_recurrent_kda_device", old.get("device"))
    names = _arg("--rows", ",".join(ROWS)).split(",") if _arg("--rows") != "none" else []
    # the merged file's named rows stay until this run replaces them (a call killed mid-row keeps them all); each
    # row names the commit and the card it was measured on (rows from before those fields: the merged file's header)
    rows = res["chunk_kda"] = [{**r, "commit": r.get("commit", old.get("commit")),
                                "device": r.get("device", old.get("device"))}
                               for r in old.get("chunk_kda", []) if "row" in r]
    for key, value in old.items():  # the merged file's other entries (earlier sessions' figures) stay as they were
        if key not in res and key != "chunk_kda":
            res[key] = value
    if any("row" not in r for r in old.get("chunk_kda", [])):  # rows of the format before named rows
        res.setdefault("chunk_kda_unnamed_rows", [r for r in old["chunk_kda"] if "row" not in r])
    save()   # the merged entries too, even when no row runs (`--rows none`)
    for name in names:
        if time.time() - start > budget:
            print("budget: not started", name, flush=True)
            continue
        xs, do, cu, params, T, heads = row_inputs(name)
        try:
            row = dict(row=name, T=T, heads=heads, **run_pair(fla_kda, xs, do, cu=cu, check=T <= 32768,
                                                              rep=100 if T * heads <= 32768 * 16 else 30,
                                                              gate=params), **floors(T, copy_Bps, mm_flops, heads))
        except torch.cuda.OutOfMemoryError as e:
            row = dict(row=name, T=T, heads=heads, error=str(e)[:200])
        if cu is not None:
            row["varlen"] = cu.tolist()
        row["commit"], row["device"] = res["commit"], res["device"]
        print("kda", row, flush=True)
        rows[:] = [r for r in rows if r["row"] != name] + [row]
        save()
        del xs, do
        torch.cuda.empty_cache()
    print(f"\n{'row':>22} {'fla fwd':>8} {'ours':>7} {'x':>5} | {'fla bwd':>8} {'ours':>7} {'x':>5}")
    for r in sorted(rows, key=lambda r: ROWS.index(r["row"]) if r.get("row") in ROWS else 99):
        if "fla_fwd_ms" in r:
            print(f"{r['row']:>22} {r['fla_fwd_ms']:>8.3f} {r['ours_fwd_ms']:>7.3f} {r['speedup_fwd']:>5.2f} | "
                  f"{r['fla_bwd_ms']:>8.3f} {r['ours_bwd_ms']:>7.3f} {r['speedup_bwd']:>5.2f}")


if __name__ == "__main__":
    main()
