"""Block AttnRes: fla-core `fused_attnres` vs k3_kernels `fused_block_attnres` (H200), plus batch-invariant
RMSNorm vs `torch.nn.functional.rms_norm`, fused SiTU vs eager torch, and the AttnRes decode path.

Layouts (9 sources = 8 stored block rows + the partial sum, D = 7168, bf16):
* `k3`: the bank is one `[N, 8, D]` tensor (rows are its `unbind(1)` views) plus a `[N, D]` partial; the sources'
  `.grad` buffers exist before the call (in training they accumulate over the block's sub-layers). fla-core is
  called as a user would (it copies the strided rows); ours reads them in place and accumulates into `.grad`.
* `contiguous`: 9 separate `[N, D]` leaves with `.grad` reset to None before every call (the anchor's setup,
  shared/anchors/bench_fla.py): both sides allocate the 9 gradients.
Medians of `triton.testing.do_bench` (it zeroes a 256 MB buffer before each call, so a call whose host side takes
longer than ~85 us plus its kernels is measured at its host-side latency); peak extra = max allocated during one
forward+backward minus allocated before it. Floor = bytes that must move / measured copy bandwidth. The RMSNorm
rows add the kernels' own device time (torch.profiler, in the last part `norm_profile`: no timing runs after a
profile) and `norm_host_overhead` the host time per call at 8 rows. Writes benchmarks/results/attnres.json (or
$OUT/attnres.json when OUT is set) after every part. BENCH_PARTS picks parts (norm, norm_host, decode, attnres,
sweep, norm_profile); BENCH_FLA=0 skips fla-core (its first call autotunes ~70 s).
The committed results file holds the latest full run ("final": fla-core and ours in one process) and the earlier
runs under "history" (see its "note").
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from k3_kernels.attnres import block_attnres_decode, fused_block_attnres
from k3_kernels.attnres import fused as ours_mod
from k3_kernels.norm import gated_rms_norm, naive_gated_rms_norm, rms_norm
from k3_kernels.situ import naive_situ_and_mul, situ_and_mul

GiB = 2**30
dev = "cuda"
# fla-core autotunes ~60 kernel configs on its first call (~70 s on the H200); BENCH_FLA=0 measures ours only
WITH_FLA = os.environ.get("BENCH_FLA", "1") != "0"


def med(fn, rep=200, grad_to_none=None) -> float:
    return do_bench(fn, warmup=10, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def peak_extra(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / GiB


def make_sources(layout: str, N: int, D: int, R: int):
    torch.manual_seed(0)
    q = (torch.randn(D, device=dev) * 0.02).requires_grad_(True)
    w = torch.ones(D, device=dev, requires_grad=True)
    partial = torch.randn(N, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    if layout == "k3":
        bank = torch.randn(N, R, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        bank.grad = torch.zeros_like(bank)
        partial.grad = torch.zeros_like(partial)
        rows = list(bank.unbind(1))
        leaves = [bank, partial]
    else:
        leaves = [torch.randn(N, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(R)]
        leaves.append(partial)
        rows = leaves[:-1]
    return rows, partial, q, w, leaves


def attnres_rows(copy_tbps: float, out: list[dict], save) -> list[dict]:
    """Appends each row to `out` and calls `save()` after it (a kill mid-part keeps the finished rows)."""
    if WITH_FLA:
        from fla.ops.attnres import fused_attnres as fla_fused_attnres

    R, D = 8, 7168
    L = R + 1
    for layout in ("k3", "contiguous"):
        for N in (4096, 32768, 131072):
            rows, partial, q, w, leaves = make_sources(layout, N, D, R)
            do = torch.randn(N, D, device=dev, dtype=torch.bfloat16)
            reset = [q, w] if layout == "k3" else [q, w, *leaves]
            impls = {"ours": lambda: fused_block_attnres(rows, partial, q, w, 1e-6)}
            if WITH_FLA:
                impls["fla"] = lambda: fla_fused_attnres(q, [*rows, partial], w)
            row = dict(layout=layout, N=N, L=L, D=D)
            unit = N * D * 2
            fwd_bytes = (L + 1) * unit
            # backward floor: read do + L sources, write L grads (+ read them when accumulating into existing .grad)
            bwd_bytes = (1 + 2 * L + (L if layout == "k3" else 0)) * unit
            row["floor_fwd_ms"] = fwd_bytes / (copy_tbps * 1e12) * 1e3
            row["floor_fwdbwd_ms"] = (fwd_bytes + bwd_bytes) / (copy_tbps * 1e12) * 1e3
            for name, f in impls.items():
                def fb(f=f):
                    f().backward(do)
                t0 = time.time()
                fb()
                torch.cuda.synchronize()
                row[f"{name}_first_call_s"] = time.time() - t0
                with torch.no_grad():
                    row[f"{name}_fwd_ms"] = med(f)
                row[f"{name}_fwdbwd_ms"] = med(fb, grad_to_none=reset)
                for t in reset:
                    t.grad = None
                row[f"{name}_peak_extra_GiB"] = peak_extra(fb)
                for t in reset:
                    t.grad = None
                torch.cuda.empty_cache()
            if WITH_FLA:
                row["speedup_fwd"] = row["fla_fwd_ms"] / row["ours_fwd_ms"]
                row["speedup_fwdbwd"] = row["fla_fwdbwd_ms"] / row["ours_fwdbwd_ms"]
                row["peak_ratio"] = row["ours_peak_extra_GiB"] / row["fla_peak_extra_GiB"]
            row["ours_fwd_TBps"] = fwd_bytes / (row["ours_fwd_ms"] * 1e-3) / 1e12
            row["ours_fwdbwd_of_floor"] = row["floor_fwdbwd_ms"] / row["ours_fwdbwd_ms"]
            print("attnres", json.dumps(row), flush=True)
            out.append(row)
            save()
            del rows, partial, q, w, leaves, do, impls
            torch.cuda.empty_cache()
    return out


def sweep(N: int = 32768) -> list[dict]:
    """Launch-config sweep on the k3 layout (forward configs timed forward-only, backward configs timed
    forward+backward with the default forward); the chosen config is the default in fused.py."""
    R, D = 8, 7168
    rows, partial, q, w, leaves = make_sources("k3", N, D, R)
    do = torch.randn(N, D, device=dev, dtype=torch.bfloat16)
    orig = ours_mod._config
    base = orig(D)
    res = []
    f = lambda: fused_block_attnres(rows, partial, q, w, 1e-6)
    fb = lambda: f().backward(do)
    trials = [("fwd", c) for c in [(16, 4, 1), (16, 4, 2), (8, 2, 2), (8, 4, 2), (16, 8, 1), (4, 2, 4), (8, 1, 4),
                                    (4, 1, 4)]]
    trials += [("bwd", c) for c in [(16, 1, 1), (8, 1, 2), (16, 1, 2), (4, 1, 4)]]
    for kind, (warps, tl_, per_sm) in trials:
        if kind == "fwd":
            cfg = base._replace(warps_fwd=warps, tl_fwd=tl_, per_sm_fwd=per_sm)
        else:
            cfg = base._replace(warps_bwd=warps, per_sm_bwd=per_sm)
        ours_mod._config = lambda D, cfg=cfg: cfg
        r = dict(kind=kind, warps=warps, tl=tl_, per_sm=per_sm)
        try:
            if kind == "fwd":
                with torch.no_grad():
                    f()
                    r["fwd_ms"] = med(f, rep=100)
            else:
                fb()
                r["fwdbwd_ms"] = med(fb, rep=100, grad_to_none=[q, w])
        except Exception as e:  # a config that does not compile/fit is recorded, not fatal
            r["error"] = repr(e)[:200]
        print("sweep", json.dumps(r), flush=True)
        res.append(r)
    ours_mod._config = orig
    del rows, partial, leaves, do
    torch.cuda.empty_cache()
    return res


def decode_rows() -> list[dict]:
    out = []
    R, D = 8, 7168
    for B in (1, 64, 512):
        torch.manual_seed(0)
        srcs = [torch.randn(B, D, device=dev, dtype=torch.bfloat16) for _ in range(R + 1)]
        q = torch.randn(D, device=dev) * 0.02
        w = torch.ones(D, device=dev)
        # ours only: fla-core has no decode path, and its forward would autotune again for these shapes
        row = dict(B=B, ours_decode_us=med(lambda: block_attnres_decode(srcs[:-1], srcs[-1], q, w, 1e-6),
                                           rep=100) * 1e3)
        print("decode", json.dumps(row), flush=True)
        out.append(row)
    return out


def _gpu_kernel_ms(fn, n: int = 20) -> dict:
    """Device time of the kernels one call of `fn` runs (torch.profiler, CUDA activity): the GPU-only cost,
    without the host's launch overhead. Per kernel name (ms per call) and their sum."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    kern = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0) or 0
        if t > 0 and str(getattr(e, "device_type", "")).endswith("CUDA"):
            kern[e.key[:80]] = t / n / 1e3
    return {"kernels_ms": kern, "gpu_ms": sum(kern.values())}


def _host_us(fn, n: int = 300) -> float:
    """Wall time per call of a back-to-back loop at a size where the GPU work is negligible: the host cost."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


class _Trivial(torch.autograd.Function):
    """An autograd.Function that launches nothing: the floor of any Python-level custom op."""

    @staticmethod
    def forward(ctx, x, w):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


def norm_host_overhead() -> dict:
    """Host cost per call (M = 8 rows: the GPU work is a few microseconds), to separate launch overhead from
    kernel time in the small-batch rows."""
    D = 7168
    x = torch.randn(8, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    fns = {"torch": lambda: F.rms_norm(x, (D,), w, 1e-6), "ours": lambda: rms_norm(x, w, 1e-6),
           "trivial_autograd_function": lambda: _Trivial.apply(x, w)}
    out = {}
    for name, f in fns.items():
        def fb(f=f):
            x.grad = w.grad = None
            f().backward(dy)
        with torch.no_grad():
            out[f"{name}_fwd_us"] = _host_us(f)
        out[f"{name}_fwdbwd_us"] = _host_us(fb)
    y = torch.empty(1, device=dev)
    out["torch_empty_us"] = _host_us(lambda: torch.empty(8, D, device=dev, dtype=torch.bfloat16))
    out["torch_add_us"] = _host_us(lambda: torch.add(y, 1.0))
    print("norm_host", json.dumps(out), flush=True)
    return out


# (row, name, one fwd+bwd) of the RMSNorm rows, profiled by the `norm_profile` part after every timing: a
# torch.profiler session leaves CUPTI subscribed, which adds host time to every later launch (measured: our 4K-row
# fwd+bwd 0.197 ms timed after a profile, 0.122 ms with profiles last; H200, torch 2.11).
_NORM_TO_PROFILE: list = []


def norm_rows() -> list[dict]:
    out = []
    D = 7168
    for M in (4096, 8192, 32768):
        torch.manual_seed(0)
        x = torch.randn(M, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w = (1 + 0.1 * torch.randn(D, device=dev)).to(torch.bfloat16).requires_grad_(True)
        dy = torch.randn_like(x)
        row = dict(op="rms_norm", M=M, D=D)
        for name, f in {"torch": lambda x=x, w=w: F.rms_norm(x, (D,), w, 1e-6),
                        "ours": lambda x=x, w=w: rms_norm(x, w, 1e-6)}.items():  # bound: profiled later
            def fb(f=f):
                f().backward(dy)
            with torch.no_grad():
                row[f"{name}_fwd_ms"] = med(f)
            row[f"{name}_fwdbwd_ms"] = med(fb, grad_to_none=[x, w])
            def fbn(f=f, x=x, w=w, dy=dy):
                x.grad = w.grad = None
                f().backward(dy)
            _NORM_TO_PROFILE.append((row, name, fbn))
            x.grad = w.grad = None
        row["fwd_ratio"] = row["ours_fwd_ms"] / row["torch_fwd_ms"]
        row["fwdbwd_ratio"] = row["ours_fwdbwd_ms"] / row["torch_fwdbwd_ms"]
        print("norm", json.dumps(row), flush=True)
        out.append(row)
        del x, w, dy
    # gated (KDA output: per head, D = 128) vs the eager reference
    x = torch.randn(32768 * 16, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x).requires_grad_(True)
    w = torch.ones(128, device=dev, dtype=torch.float32, requires_grad=True)
    dy = torch.randn_like(x)
    row = dict(op="gated_rms_norm", M=x.shape[0], D=128)
    for name, f in {"eager": lambda: naive_gated_rms_norm(x, g, w, 1e-6),
                    "ours": lambda: gated_rms_norm(x, g, w, 1e-6)}.items():
        with torch.no_grad():
            row[f"{name}_fwd_ms"] = med(f)
        row[f"{name}_fwdbwd_ms"] = med(lambda f=f: f().backward(dy), grad_to_none=[x, g, w])
    print("norm", json.dumps(row), flush=True)
    out.append(row)
    del x, g, w, dy
    # SiTU on a latent-MoE-sized activation
    gu = torch.randn(32768, 2 * 3072, device=dev, dtype=torch.bfloat16, requires_grad=True)
    gt, up = gu.chunk(2, -1)
    dy = torch.randn(32768, 3072, device=dev, dtype=torch.bfloat16)
    row = dict(op="situ_and_mul", M=32768, I=3072)
    for name, f in {"eager": lambda: naive_situ_and_mul(gt, up), "ours": lambda: situ_and_mul(gt, up)}.items():
        with torch.no_grad():
            row[f"{name}_fwd_ms"] = med(f)
        row[f"{name}_fwdbwd_ms"] = med(lambda f=f: f().backward(dy, retain_graph=True), grad_to_none=[gu])
    print("norm", json.dumps(row), flush=True)
    out.append(row)
    return out


def norm_profile() -> list[dict]:
    """Kernels' own device time (no host overhead) of each RMSNorm row's fwd+bwd, added to those rows."""
    profiled = []
    for row, name, fn in _NORM_TO_PROFILE:
        try:
            prof = _gpu_kernel_ms(fn)
            row[f"{name}_fwdbwd_gpu_ms"] = prof["gpu_ms"]
            row[f"{name}_fwdbwd_kernels_ms"] = prof["kernels_ms"]
        except Exception as e:  # the profiler is a diagnostic: its failure must not lose the timings
            row[f"{name}_profile_error"] = repr(e)[:200]
        profiled.append({"M": row["M"], "name": name})
    _NORM_TO_PROFILE.clear()
    return profiled


def main() -> None:
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "python": sys.version.split()[0], "with_fla": WITH_FLA}
    if WITH_FLA:
        import fla
        res["fla_core"] = getattr(fla, "__version__", "?")
    x = torch.randn(1 << 29, device=dev, dtype=torch.bfloat16)  # 1 GiB
    y = torch.empty_like(x)
    res["copy_TBps"] = 2 * x.numel() * 2 / (med(lambda: y.copy_(x)) * 1e-3) / 1e12
    del x, y
    print("copy_TBps", res["copy_TBps"], flush=True)
    parts = os.environ.get("BENCH_PARTS", "norm,norm_host,decode,attnres,norm_profile").split(",")
    path = os.path.join(os.environ.get("OUT", os.path.join(os.path.dirname(__file__), "results")), "attnres.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)

    def save() -> None:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)

    def attnres() -> list[dict]:
        res["attnres"] = []
        return attnres_rows(res["copy_TBps"], res["attnres"], save)

    runs = {"sweep": ("config_sweep_N32K", sweep), "attnres": ("attnres", attnres),
            "decode": ("decode", decode_rows), "norm": ("norm", norm_rows),
            "norm_host": ("norm_host_overhead", norm_host_overhead), "norm_profile": ("norm_profiled", norm_profile)}
    for part in parts:
        key, fn = runs[part]
        try:
            res[key] = fn()
        except Exception as e:  # keep the other parts' figures (and a part's finished rows); record the error
            res[f"{key}_error"] = repr(e)[:500]
            print(part, "failed:", repr(e), flush=True)
        torch.cuda.empty_cache()
        save()  # after every part: a later part's hang or kill keeps the earlier figures
    summary(res)


def summary(res: dict) -> None:
    """The headline tables, one line per row."""
    for r in res.get("attnres", []):
        print("SUMMARY attnres {layout} N={N}: fwd fla {fla:.3f} ours {ours_fwd_ms:.3f} ms | fwd+bwd fla {flab:.3f} "
              "ours {ours_fwdbwd_ms:.3f} ms speedup {sp:.2f}x | peak extra fla {flap:.3f} ours {ours_peak_extra_GiB:.3f}"
              " GiB ratio {pr:.3f}".format(fla=r.get("fla_fwd_ms", float("nan")), flab=r.get("fla_fwdbwd_ms", float("nan")),
                                            sp=r.get("speedup_fwdbwd", float("nan")),
                                            flap=r.get("fla_peak_extra_GiB", float("nan")),
                                            pr=r.get("peak_ratio", float("nan")), **r), flush=True)
    for r in res.get("norm", []):
        if r.get("op") == "rms_norm":
            print("SUMMARY rms_norm M={M}: fwd torch {torch_fwd_ms:.4f} ours {ours_fwd_ms:.4f} ({fwd_ratio:.2f}x) | "
                  "fwd+bwd torch {torch_fwdbwd_ms:.4f} ours {ours_fwdbwd_ms:.4f} ({fwdbwd_ratio:.2f}x) | gpu-only "
                  "torch {tg} ours {og}".format(tg=r.get("torch_fwdbwd_gpu_ms"), og=r.get("ours_fwdbwd_gpu_ms"), **r),
                  flush=True)
        else:
            print("SUMMARY", json.dumps(r), flush=True)
    if "norm_host_overhead" in res:
        print("SUMMARY host", json.dumps(res["norm_host_overhead"]), flush=True)


if __name__ == "__main__":
    main()
