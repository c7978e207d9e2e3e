"""Latent-MoE layer on one GPU: TorchTitan 0.3.0's MoE layer and a naive torch loop vs ours (bf16 and FP8), in one
process, at K3's expert widths (latent 3584, intermediate 3072, top-16, 2 shared experts) with 112 local experts
(EP = 8's share of 896) and with all 896, for 4K / 16K / 32K tokens.

* TorchTitan: `MoE` (`TokenChoiceTopKRouter` with sigmoid scores + route_norm, `LocalTokenDispatcher`,
  `GroupedExperts` on `torch._grouped_mm`, shared `FeedForward` of 2 x 3072), built from its own configs; as
  shipped its gate runs in fp32 (autocast) and its experts use SiLU.
* naive: k3_kernels.moe.naive (the spec: per-expert torch loop, its router, SiTU).
* ours: `fused_router` (bf16 operands, fp32 accumulation) + `moe_experts` (grouped GEMMs, SiTU fused, bf16
  or FP8 forward) + the shared SiTU MLP on cuBLAS with the fused SiTU kernel. FP8: the weights' FP8 copies are
  made once per weight version (once per optimizer step) and reused, so the timed calls exclude it; its cost is
  `fp8_weight_quant_ms`. `ours_fp8_full`: every GEMM in e4m3, the backward's too (Precision.FP8_FULL,
  k3_kernels.moe.fp8_grad). `ours_*`: the default grouped-GEMM kernels (on sm_90 the warp-specialised Gluon ones,
  k3_kernels.moe.gluon_gemm / gluon_bf16, but for the bf16 wgrad); `ours_*_triton` / `ours_*_gluon`: every
  grouped GEMM on the Triton / on the Gluon kernels (the A/B; same bits).
The routed-expert weights are the same tensors for all (their gradients reset between runs). Times are medians
of `triton.testing.do_bench`; peak = max allocated during one call minus allocated before it; floors = the FLOPs
over the measured bf16 (or FP8) GEMM rate, and the bytes that must move (weights, their gradients, the layer's
input and output) over the measured copy bandwidth. Determinism: two forward+backward runs compared bit for bit,
and a token subset's forward against the full batch's rows (batch invariance).
`--gluon-gemms E,N`: each grouped GEMM alone (bf16, FP8), Triton vs Gluon (same bits? TFLOP/s), Gluon settings swept.
`--profile E,N`: every kernel's device time in one forward+backward of ours (FP8_FULL, FP8).
`--smoke`: tiny shapes on CPU (our kernels in Triton's interpreter), to check the script. Writes
benchmarks/results/moe.json (or $OUT/moe.json when OUT is set).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

# Both layers run under TorchTitan's allocator setting: its RL trainer sets expandable segments before importing
# torch (torchtitan 0.3.0, experiments/rl/train.py), as its run_train.sh launcher does. The JSON records the value;
# `PYTORCH_CUDA_ALLOC_CONF= python3 -m benchmarks.moe ...` measures the default allocator.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

if not torch.cuda.is_available():  # the smoke run: our kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks._numerics import rel_rms  # noqa: E402
from benchmarks._results import run_header, write_results  # noqa: E402
from benchmarks._timeline import busy_and_gaps  # noqa: E402
from benchmarks.moe_gemms import (BETA, LINEAR_BETA, apply_pass_setting, gluon_gemms, measure,  # noqa: E402
                                  parse_pass_settings, parse_tile_changes, sweep, timed_cpu)
from k3_kernels.moe import naive  # noqa: E402
from k3_kernels.moe.layer import Precision, clear_fp8_cache, moe_experts  # noqa: E402
from k3_kernels.moe.quant import quantize_weight_fp8  # noqa: E402
from k3_kernels.moe.router import fused_router  # noqa: E402
from k3_kernels.situ import naive_situ_and_mul  # noqa: E402

GiB = 2 ** 30


def situ(g, u):
    if g.is_cuda:
        from k3_kernels.situ.fused import situ_and_mul
        return situ_and_mul(g, u, BETA, LINEAR_BETA)
    return naive_situ_and_mul(g, u, BETA, LINEAR_BETA)


class OursMoE(nn.Module):
    """Our layer at the expert width: fused router + grouped-GEMM experts + shared SiTU MLP."""

    def __init__(self, router_w, w1, w3, w2, shared, top_k, precision):
        super().__init__()
        self.router_w, self.w1, self.w3, self.w2 = router_w, w1, w3, w2
        self.sg, self.su, self.sd = shared
        self.bias = torch.zeros(router_w.shape[0], device=router_w.device)
        self.top_k, self.precision = top_k, precision

    def routed(self, x):
        ids, w = fused_router(x, self.router_w, self.bias, self.top_k)
        # the router's own ids are in range: no host-side range check, as k3.model.moe passes them
        return moe_experts(x, ids, w, self.w1, self.w3, self.w2, BETA, LINEAR_BETA, self.precision, ids_checked=True)

    def forward(self, x):
        return self.routed(x) + F.linear(situ(F.linear(x, self.sg), F.linear(x, self.su)), self.sd)


class _OursOn(OursMoE):
    """Ours with the grouped GEMMs on the kernels named by `KERNELS` (a `gemm_kernels` block around the forward;
    the backward runs under the forward's choice)."""
    KERNELS = "triton"

    def routed(self, x):
        from k3_kernels.moe import grouped_gemm as gg
        with gg.gemm_kernels(gg.GemmKernels(self.KERNELS)):
            return super().routed(x)


class OursMoETriton(_OursOn):
    """Every grouped GEMM on the Triton kernels (the CPU-tested path; the default before session 31)."""
    KERNELS = "triton"


class OursMoEGluon(_OursOn):
    """Every grouped GEMM on the Gluon kernels, the bf16 wgrad too (which the default keeps on Triton)."""
    KERNELS = "gluon"


class NaiveMoE(OursMoE):
    def forward(self, x):
        return naive.naive_moe_layer(x, self.router_w, self.bias, self.w1, self.w3, self.w2, self.top_k,
                                     (self.sg, self.su, self.sd), BETA, LINEAR_BETA)[0]


def torchtitan_moe(L, I, E, k, n_shared, device, dtype):
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import MoE, GroupedExperts, RoutedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    S = n_shared * I
    cfg = MoE.Config(
        num_experts=E,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=L, hidden_dim=I, num_experts=E),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=k)),
        router=TokenChoiceTopKRouter.Config(num_experts=E, gate=Linear.Config(in_features=L, out_features=E),
                                            top_k=k, score_func="sigmoid", route_norm=True),
        load_balance_coeff=1e-3,
        shared_experts=FeedForward.Config(w1=Linear.Config(in_features=L, out_features=S),
                                          w2=Linear.Config(in_features=S, out_features=L),
                                          w3=Linear.Config(in_features=L, out_features=S)))
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in bf16 directly: 896 experts in fp32 would not fit
    try:
        with torch.device(device):
            m = cfg.build()
    finally:
        torch.set_default_dtype(prev)
    m.expert_bias_E = m.expert_bias_E.float()
    m.tokens_per_expert_E = m.tokens_per_expert_E.float()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.02)
    return m


class TorchTitanLayer(nn.Module):
    """TorchTitan's MoE on [N, L] rows (it takes [B, S, L])."""

    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def forward(self, x):
        return self.moe(x[None])[0]


def peak_extra(fn, device):
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / GiB


def rates(device):
    """Measured bf16 / FP8 GEMM rates (TFLOP/s) and copy bandwidth (GB/s): the floors' denominators."""
    if device.type != "cuda":
        return None
    from triton.testing import do_bench
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    t16 = do_bench(lambda: a @ b, rep=100, return_mode="median")
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
    one = torch.ones((), device=device)
    try:
        t8 = do_bench(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16), rep=100,
                      return_mode="median")
    except RuntimeError:
        t8 = None
    big = torch.empty(2 * GiB // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(big)
    tc = do_bench(lambda: dst.copy_(big), rep=100, return_mode="median")
    return {"bf16_tflops": 2 * n ** 3 / t16 / 1e9, "fp8_tflops": 2 * n ** 3 / t8 / 1e9 if t8 else None,
            "copy_gbps": 2 * big.numel() * 2 / tc / 1e6}


def floors(N, L, I, E, k, n_shared, rate, fp8, backward_fp8=False):
    if rate is None:
        return None
    P = N * k
    f_fwd = 2 * P * 3 * L * I + 2 * N * 3 * L * n_shared * I + 2 * N * L * E
    w_bytes = (3 * E * L * I + 3 * n_shared * I * L + E * L) * 2
    act = 2 * N * L * 2
    tf = rate["fp8_tflops"] if fp8 and rate["fp8_tflops"] else rate["bf16_tflops"]
    bw = rate["copy_gbps"] * 1e6  # bytes per ms
    fwd_ms = max(f_fwd / (tf * 1e9), (w_bytes + act) / bw)
    # backward: dgrad + wgrad (2x the forward FLOPs), weights read again, their gradients written
    tb = tf if backward_fp8 else rate["bf16_tflops"]
    fb_ms = max((f_fwd / (tf * 1e9)) + 2 * f_fwd / (tb * 1e9), (3 * w_bytes + 2 * act) / bw)
    return {"fwd_ms": fwd_ms, "fwd_bwd_ms": fb_ms, "fwd_tflop": f_fwd / 1e12}


def run_point(impls, N, L, device, dtype, reps_ms, params):
    torch.manual_seed(1)
    x = (torch.randn(N, L, device=device) * 0.5).to(dtype).requires_grad_()
    dy = torch.randn(N, L, device=device).to(dtype)
    out = {}
    for name, mod in impls.items():
        entry = {}
        grads = [x] + params[name]

        def fwd():
            with torch.no_grad():
                return mod(x)

        def fwd_bwd():
            for p in grads:  # (do_bench's warm-up calls keep gradients: accumulating them costs a copy of each)
                p.grad = None
            mod(x).backward(dy)

        def stage(key, fn):
            """One measurement; out of memory is recorded for that figure (the next ones still run)."""
            try:
                entry[key] = fn()
            except torch.cuda.OutOfMemoryError as err:
                entry[key] = None
                entry.setdefault("errors", {})[key] = f"out of memory: {str(err).splitlines()[0][:120]}"
            for p in grads:
                p.grad = None
            if device.type == "cuda":
                torch.cuda.empty_cache()

        def timing(fn):
            if device.type == "cuda":
                return measure(fn, reps_ms, None)
            return timed_cpu(fn, 1)

        def rerun():
            runs = []
            for _ in range(2):
                for p in grads:
                    p.grad = None
                y = mod(x)
                y.backward(dy)
                runs.append([y.detach().clone()] + [p.grad.clone() for p in grads])
            entry["_y"] = runs[0][0]
            return all(torch.equal(a, b) for a, b in zip(*runs))

        stage("fwd_ms", lambda: timing(fwd))
        stage("fwd_bwd_ms", lambda: timing(fwd_bwd))
        stage("peak_gib_fwd_bwd", lambda: peak_extra(fwd_bwd, device))
        # determinism: two forward+backward runs, bit for bit (output, input and all parameter gradients)
        stage("bitwise_rerun", rerun)
        if isinstance(mod, OursMoE) and not isinstance(mod, NaiveMoE):
            # router + routed experts (the shared MLP is plain cuBLAS, which picks kernels by row count)
            sub = torch.arange(0, N, 3, device=device)

            def invariant():
                with torch.no_grad():
                    return bool(torch.equal(mod.routed(x[sub]), mod.routed(x)[sub]))
            stage("routed_batch_invariant", invariant)
        if name == "ours_fp8":
            ws = params[name][1:4]
            clear_fp8_cache()
            stage("fp8_weight_quant_ms", lambda: measure(lambda: [quantize_weight_fp8(w) for w in ws], reps_ms, None)
                  if device.type == "cuda" else None)
        clear_fp8_cache()
        for p in [x] + params[name]:
            p.grad = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
        out[name] = entry
    return out


SWEEP = {  # candidate tiles (block_m, block_n, block_k, warps, stages) per kernel, timed one kernel at a time
    "gate_up": [(128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4)],
    "mm": [(128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4)],
    "wgrad": [(128, 128, 64, 8, 3), (64, 128, 128, 8, 3), (64, 128, 64, 4, 4)],
    "gate_up_fp8": [(128, 128, 128, 8, 3), (64, 128, 128, 4, 3)],
    "mm_fp8": [(128, 128, 128, 8, 3), (128, 256, 128, 8, 3)],
}


OURS = {f"ours_{prec.value}{suffix}": (cls, prec) for prec in Precision
        for suffix, cls in (("", OursMoE), ("_triton", OursMoETriton), ("_gluon", OursMoEGluon))}


def idle_gaps(prof, steps, top=12):
    """The device's idle time in a profiled run of `steps` steps: the kernels' span (first start to last end) less
    their union, and the largest gaps with the kernels on either side -- what a step's wall time has beyond the
    kernels' device time (allocator, host syncs, launch latency). Empty without CUDA events."""
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not evs:
        return {}
    _, gaps = busy_and_gaps([(e.time_range.start, e.time_range.end) for e in evs])
    span = max(e.time_range.end for e in evs) - min(e.time_range.start for e in evs)
    gaps.sort(reverse=True)
    return {"span_ms_per_step": span / 1e3 / steps, "idle_ms_per_step": sum(g for g, _, _ in gaps) / 1e3 / steps,
            "largest_gaps": [{"ms": g / 1e3, "after": evs[i].name[:60], "before": evs[j].name[:60]}
                             for g, i, j in gaps[:top]]}


def step_walls(step, device, reps=5):
    """Wall time of `reps` synchronised steps (ms, median) and the host's time to enqueue one (ms)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    walls = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        walls.append((time.perf_counter() - t0) * 1e3)
    sync()
    t0 = time.perf_counter()
    step()
    host_ms = (time.perf_counter() - t0) * 1e3
    sync()
    return {"wall_ms_median": sorted(walls)[len(walls) // 2], "host_enqueue_ms": host_ms}


def kernel_profile(E, N, L, I, k, n_shared, device, dtype, steps=3, top=40):
    """Where a forward+backward of our layer spends its device time: every kernel's time per step (torch.profiler,
    `steps` steps after 3 warm-ups), the device's idle gaps between kernels, and the step's wall and host-enqueue
    times (measured before any profiling), FP8_FULL and FP8 with the default grouped-GEMM kernels."""
    torch.manual_seed(2)
    p = lambda *shape: nn.Parameter((torch.randn(*shape, device=device) * 0.02).to(dtype))  # noqa: E731
    router_w, w1, w3, w2 = p(E, L), p(E, I, L), p(E, I, L), p(E, L, I)
    shared = [p(n_shared * I, L), p(n_shared * I, L), p(L, n_shared * I)]
    x = (torch.randn(N, L, device=device) * 0.5).to(dtype).requires_grad_()
    dy = torch.randn(N, L, device=device).to(dtype)
    activity = (torch.profiler.ProfilerActivity.CUDA if device.type == "cuda"
                else torch.profiler.ProfilerActivity.CPU)
    out = {"experts": E, "tokens": N, "steps": steps}
    params = [x, router_w, w1, w3, w2, *shared]

    def warm_step(precision):
        mod = OursMoE(router_w, w1, w3, w2, shared, k, precision)

        def step():
            for t in params:
                t.grad = None
            mod(x).backward(dy)
        for _ in range(3):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return step

    precisions = (Precision.FP8_FULL, Precision.FP8)
    # wall times first: launches stay slower in a process once a profiler has run (CUPTI; decode_profile.py)
    walls = {}
    for precision in precisions:
        walls[precision] = step_walls(warm_step(precision), device)
        clear_fp8_cache()
    for precision in precisions:
        step = warm_step(precision)
        with torch.profiler.profile(activities=[activity]) as prof:
            for _ in range(steps):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize()
        per_step = [(e.key, (e.device_time_total if device.type == "cuda" else e.self_cpu_time_total) / steps / 1e3,
                     e.count // steps) for e in prof.key_averages()]
        per_step.sort(key=lambda r: -r[1])
        r = out[precision.value] = {"total_ms": sum(ms for _, ms, _ in per_step),
                                    "kernels": [{"name": n[:120], "ms": ms, "calls": c}
                                                for n, ms, c in per_step[:top]],
                                    **idle_gaps(prof, steps), **walls[precision]}
        print("profile", precision.value, f"{r['total_ms']:.2f} ms of kernels, idle {r.get('idle_ms_per_step', 0):.2f}"
              f" ms, wall {r['wall_ms_median']:.2f} ms (host enqueue {r['host_enqueue_ms']:.2f} ms)", flush=True)
        clear_fp8_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (interpreter): checks the script")
    ap.add_argument("--experts", default="112,896")
    ap.add_argument("--tokens", default="4096,16384,32768")
    ap.add_argument("--impls", default="torchtitan,naive,ours_bf16,ours_fp8,ours_fp8_full",
                    help=f"any of torchtitan, naive, {', '.join(OURS)}")
    ap.add_argument("--profile", default=None, help="E,N: each kernel's device time in one forward+backward of "
                    "ours (FP8_FULL and FP8, the default kernels), torch.profiler, at that point first")
    ap.add_argument("--naive-max-tokens", type=int, default=4096, help="the naive loop only up to this many tokens")
    ap.add_argument("--rep-ms", type=int, default=150)
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", default=None, help="E,N: per-kernel tile sweep at that point first")
    ap.add_argument("--gluon-gemms", default=None, help="E,N: each grouped GEMM (bf16 and FP8), Triton vs Gluon "
                    "(bits and time), and the Gluon kernels' settings swept, at that point first")
    ap.add_argument("--gemms", default=None, help="with --gluon-gemms: only these GEMMs (comma-separated names of "
                    "gluon_gemms' table, 'passes' for the quantisation passes), in the A/B and the sweep")
    ap.add_argument("--fp8-tiles", default=None, help="with --gluon-gemms: the FP8 GluonTile changes to sweep "
                    "instead of moe_gemms.GLUON_FP8_TILES, e.g. 'mm_block_n=256,mm_block_n=256+stages=3' ('' = none)")
    ap.add_argument("--fp8-tile", default=None, help="the layer rows and the profile with this GluonTile change "
                    "(e.g. 'mm_block_n=128+stages=4'; recorded in the JSON)")
    ap.add_argument("--pass-settings", default=None, help="with --gluon-gemms and 'passes': the quantisation passes' "
                    "program sizes to sweep instead of moe_gemms.PASS_SETTINGS, e.g. '16/4/64/8,32/8/64/4' (row-pass "
                    "rows/warps/token-block columns/warps)")
    ap.add_argument("--pass-setting", default=None, help="the layer rows and the profile with these quantisation "
                    "pass program sizes (rows/warps/columns/warps; recorded in the JSON)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:  # fp32: the interpreter's bf16 dots are not the GPU's (tests/kernels/conftest.py)
        L, I, k, n_shared = 128, 128, 2, 2
        experts, tokens = [4], [16]
    else:
        L, I, k, n_shared = 3584, 3072, 16, 2
        # (--experts "": no layer rows, e.g. with --gluon-gemms alone)
        experts, tokens = [int(v) for v in args.experts.split(",") if v], [int(v) for v in args.tokens.split(",")]
    impl_names = args.impls.split(",")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    result = {**run_header("moe", device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                            packages=("triton", "torchtitan")),
              "shapes": {"latent": L, "intermediate": I, "top_k": k, "shared_experts": n_shared},
              "rates": rates(device), "allocator": os.environ["PYTORCH_CUDA_ALLOC_CONF"], "points": []}
    path = args.out or (os.path.join(os.environ["OUT"], "moe.json") if os.environ.get("OUT") else "moe")
    if args.gluon_gemms:
        E_s, N_s = (int(v) for v in args.gluon_gemms.split(","))
        result["gluon_gemms"] = gluon_gemms(E_s, N_s, L, I, k, device, args.rep_ms,
                                            set(args.gemms.split(",")) if args.gemms else None,
                                            None if args.fp8_tiles is None else parse_tile_changes(args.fp8_tiles),
                                            parse_pass_settings(args.pass_settings) if args.pass_settings else None)
        write_results(path, result)
    if args.fp8_tile:
        from k3_kernels.moe import gluon_gemm
        gluon_gemm.DEFAULT_TILE = dataclasses.replace(gluon_gemm.DEFAULT_TILE,
                                                      **parse_tile_changes(args.fp8_tile)[-1])
        result["fp8_tile"] = dataclasses.asdict(gluon_gemm.DEFAULT_TILE)
    if args.pass_setting:
        setting, = parse_pass_settings(args.pass_setting)
        result["pass_setting"] = apply_pass_setting(setting)
    if args.profile:
        E_s, N_s = (int(v) for v in args.profile.split(","))
        result["profile"] = kernel_profile(E_s, N_s, L, I, k, n_shared, device, dtype)
        write_results(path, result)
    if args.sweep:
        E_s, N_s = (int(v) for v in args.sweep.split(","))
        result["sweep"] = sweep(E_s, N_s, L, I, k, device, args.rep_ms)
        write_results(path, result)
    for E in experts:
        tt = torchtitan_moe(L, I, E, k, n_shared, device, dtype) if "torchtitan" in impl_names else None
        torch.manual_seed(2)
        if tt is not None:
            ge = tt.routed_experts.inner_experts
            w1, w3, w2 = ge.w1_EFD, ge.w3_EFD, ge.w2_EDF
            router_w = tt.router.gate.weight
        else:
            w1 = nn.Parameter((torch.randn(E, I, L, device=device) * 0.02).to(dtype))
            w3 = nn.Parameter((torch.randn(E, I, L, device=device) * 0.02).to(dtype))
            w2 = nn.Parameter((torch.randn(E, L, I, device=device) * 0.02).to(dtype))
            router_w = nn.Parameter((torch.randn(E, L, device=device) * 0.02).to(dtype))
        shared = [nn.Parameter((torch.randn(*s, device=device) * 0.02).to(dtype))
                  for s in ((n_shared * I, L), (n_shared * I, L), (L, n_shared * I))]
        impls, params = {}, {}
        mine = [router_w, w1, w3, w2, *shared]
        if tt is not None:
            impls["torchtitan"], params["torchtitan"] = TorchTitanLayer(tt), list(tt.parameters())
        for name, (cls, precision) in OURS.items():
            if name in impl_names:
                impls[name], params[name] = cls(router_w, w1, w3, w2, shared, k, precision), mine
        naive_mod = NaiveMoE(router_w, w1, w3, w2, shared, k, Precision.BF16) if "naive" in impl_names else None
        for N in tokens:
            run = dict(impls)
            if naive_mod is not None and N <= args.naive_max_tokens:
                run["naive"], params["naive"] = naive_mod, mine
            t0 = time.time()
            res = run_point(run, N, L, device, dtype, args.rep_ms, params)
            point = {"experts": E, "tokens": N}
            ref = res.get("ours_bf16", {}).get("_y")
            for name, entry in res.items():
                y = entry.pop("_y", None)
                if ref is not None and y is not None and name != "ours_bf16" and (name in OURS or name == "naive"):
                    entry["rel_rms_vs_ours_bf16"] = rel_rms(y, ref)
                point[name] = entry
            tt_fb = point.get("torchtitan", {}).get("fwd_bwd_ms")
            for name in OURS:
                ours = point.get(name, {})
                if tt_fb and ours.get("fwd_bwd_ms"):
                    ours["speedup_fwd_bwd_vs_torchtitan"] = tt_fb / ours["fwd_bwd_ms"]
                    ours["speedup_fwd_vs_torchtitan"] = point["torchtitan"]["fwd_ms"] / ours["fwd_ms"]
            point["floor_bf16"] = floors(N, L, I, E, k, n_shared, result["rates"], False)
            point["floor_fp8"] = floors(N, L, I, E, k, n_shared, result["rates"], True)
            point["floor_fp8_full"] = floors(N, L, I, E, k, n_shared, result["rates"], True, backward_fp8=True)
            point["wall_s"] = time.time() - t0
            result["points"].append(point)
            print(f"E={E} N={N}: " + "  ".join(
                f"{n} fwd {p.get('fwd_ms') or float('nan'):.2f} fwd+bwd {p.get('fwd_bwd_ms') or float('nan'):.2f} ms"
                for n, p in point.items() if isinstance(p, dict) and n in run), flush=True)
            write_results(path, result)
        del impls, run, naive_mod, tt
        w1 = w3 = w2 = router_w = shared = mine = params = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print("wrote", write_results(path, result), file=sys.stderr)


if __name__ == "__main__":
    main()
