"""Where a speculative step's wall time goes on the GPU, from a torch.profiler timeline (stdout, and the traces
under `--out`): the K3-width random-weight target of decode_profile with a random, untrained draft head
(`method=drafter`, chain 3, every step drafting 3 tokens: its drafts are junk, its cost is the trained head's),
CUDA graphs on, at each batch; plain decoding beside it. Per step: the wall time, the time the device is busy
(the union of its kernels' intervals), and for each phase (host ranges: drafting, verify, picks, commit, the rest)
its host time and the device time under it. Idle device time inside a step is host-bound time.

Launches run slower under the profiler (CUPTI), so the absolute figures are above an unprofiled run's
(benchmarks/spec_decode.py's `step_phases_ms`); the split between busy and idle is what this is for.

    . benchmarks/device_env.sh && python3 -m benchmarks.step_trace --batches 1,8 --out $OUT/trace > $OUT/trace.txt
"""
from __future__ import annotations

import argparse
import gzip
import json
import shutil
import tempfile
from pathlib import Path

import torch

from benchmarks._results import run_header, write_results
from benchmarks._timeline import busy_and_gaps
from benchmarks.decode_profile import _prompts
from benchmarks.k3_width import k3_width_model
from benchmarks.spec_decode import PHASES, bench_engine, patched_phases
from k3.rollout import SamplingParams
from k3.rollout.spec import SpecConfig

def random_head(model, directory: Path, vocab: int = 64) -> Path:
    """A randomly initialised DraftHead saved where `load_drafter` reads it, scoring `vocab` draft tokens."""
    from k3.rollout.spec.drafter import DraftHead, save_drafter
    torch.manual_seed(1)
    head = DraftHead(model.config.hidden_size)
    path = directory / "random_head"
    save_drafter(head, path, {"base": "random", "draft_vocab": list(range(vocab))})
    return path


def phase_ranges():
    """Each phase of the speculative step (`PHASES`) and the whole step inside a `record_function` range: host
    ranges in the trace, without the device syncs of spec_decode.phase_timers."""
    def ranged(name, fn):
        def wrapper(*args, **kwargs):
            with torch.profiler.record_function(f"phase:{name}"):
                return fn(*args, **kwargs)
        return wrapper
    return patched_phases(ranged, step=True)


def _union(intervals: list[tuple[float, float]]) -> float:
    return busy_and_gaps(intervals)[0]


def _busy_within(kernels: list[tuple[float, float]], lo: float, hi: float) -> float:
    return _union([(max(a, lo), min(b, hi)) for a, b in kernels if b > lo and a < hi])


def _concurrent(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Time within [lo, hi) during which two or more of `intervals` run at once (kernels on several streams: the
    head beside the commit with `overlap_drafting`)."""
    edges = sorted([(max(a, lo), 1) for a, b in intervals if b > lo and a < hi]
                   + [(min(b, hi), -1) for a, b in intervals if b > lo and a < hi])
    total, running, last = 0.0, 0, lo
    for t, step in edges:
        if running >= 2:
            total += t - last
        running, last = running + step, t
    return total


def summarise(trace: dict) -> dict:
    """Per step (host range `phase:step`, or for plain decoding the engine's `_forward`s): wall, device busy, and
    per phase host ms and device-busy ms under it (kernels whose interval falls in the phase's host range shifted
    by nothing: a kernel runs after its launch, so busy time under a phase is work that phase or an earlier one
    launched), and the device time two kernels shared (`_concurrent`). Means over the steps after the first two."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in ("kernel", "gpu_memcpy",
                                                                                         "gpu_memset"))
    ranges = {}
    for e in events:
        name = e.get("name", "")
        if name.startswith("phase:") and e.get("cat") == "user_annotation":   # host ranges (not their GPU copies)
            ranges.setdefault(name[6:], []).append((e["ts"], e["ts"] + e["dur"]))
    steps = sorted(ranges.get("step", []))[2:]
    if not steps:
        return {}
    out = {"steps": len(steps), "step_ms": 0.0, "device_busy_ms": 0.0, "device_concurrent_ms": 0.0}
    for lo, hi in steps:
        out["step_ms"] += (hi - lo) / 1e3
        out["device_busy_ms"] += _busy_within(kernels, lo, hi) / 1e3
        out["device_concurrent_ms"] += _concurrent(kernels, lo, hi) / 1e3
        for p in PHASES:
            for a, b in ranges.get(p, []):
                if lo <= a and b <= hi:
                    out[f"{p}_host_ms"] = out.get(f"{p}_host_ms", 0.0) + (b - a) / 1e3
                    out[f"{p}_busy_ms"] = out.get(f"{p}_busy_ms", 0.0) + _busy_within(kernels, a, b) / 1e3
    return {k: (round(v / len(steps), 3) if k != "steps" else v) for k, v in out.items()}


def trace_run(model, batch: int, tokens: int, spec: SpecConfig | None, overlap: bool, out: Path, tag: str,
              prompts=None) -> dict:
    """One engine at decode batch `batch`: two untraced runs (builds, graph captures), then a traced one, its
    trace written gzipped to `out`/`tag`.json.gz -> `summarise`'s figures."""
    eng = bench_engine(model, spec, batch)
    if spec is not None:
        eng.spec.overlap_drafting = overlap
    prompts, sp = prompts or _prompts(batch), SamplingParams(temperature=0.0, max_tokens=tokens)
    cuda = eng.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    eng.generate(prompts, sp)   # builds, captures
    eng.generate(prompts, sp)
    sync()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        if spec is not None:
            with phase_ranges():
                eng.generate(prompts, sp)
        else:
            fwd = eng._forward

            def ranged(rows, T):
                with torch.profiler.record_function("phase:step" if T == 1 else "phase:prefill"):
                    return fwd(rows, T)
            eng._forward = ranged
            eng.generate(prompts, sp)
            eng._forward = fwd
        sync()
    raw = out / f"{tag}.json"
    prof.export_chrome_trace(str(raw))
    trace = json.loads(raw.read_text())
    with gzip.open(str(raw) + ".gz", "wt") as f:
        json.dump(trace, f)
    raw.unlink()
    return summarise(trace)


def launch_costs(model, batch: int, tokens: int, spec: SpecConfig, repeats: int = 20) -> list[dict]:
    """Host time of one `replay()` of each captured graph of a speculative engine (no profiler: the launch alone,
    the device idle before it) beside its device time (CUDA events), medians of `repeats`: what a step's idle
    device time between phases is made of. The graphs are replayed on their last inputs (the engine's own run
    left them), so the replays change only buffers the next run rewrites."""
    import statistics
    import time
    eng = bench_engine(model, spec, batch)
    prompts, sp = _prompts(batch), SamplingParams(temperature=0.0, max_tokens=tokens)
    eng.generate(prompts, sp)
    graphs = [(f"verify {k.seats}x{k.tokens} pages {k.pages}" if k.verify else f"decode {k.seats}x{k.tokens}",
               v.graph) for k, v in eng.graphs.shapes.items()]
    graphs += [(f"commit {k.verify.seats}x{k.verify.tokens} steps {k.steps}", v.graph)
               for k, v in eng.graphs.commits.items()]
    graphs += [(f"drafter {k}", v.graph) for k, v in (getattr(eng.spec.drafter, "captured", None) or {}).items()]
    rows = []
    for name, graph in graphs:
        if graph is None:
            continue
        host, device = [], []
        for _ in range(repeats):
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            t = time.perf_counter()
            graph.replay()
            host.append((time.perf_counter() - t) * 1e3)
            b.record()
            torch.cuda.synchronize()
            device.append(a.elapsed_time(b))
        rows.append({"graph": name, "launch_host_ms": round(statistics.median(host), 4),
                     "device_ms": round(statistics.median(device), 4)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--out", required=True)
    ap.add_argument("--launch", action="store_true", help="only the graphs' launch costs (no profiler)")
    ap.add_argument("--drafter-dtype", default="target", help="SpecConfig.drafter_dtype of the random head")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = k3_width_model()
    tmp = Path(tempfile.mkdtemp())
    head = random_head(model, tmp)
    spec = SpecConfig(method="drafter", draft_len=3, verify="batched", drafter_path=str(head), lookup=0,
                      drafter_dtype=a.drafter_dtype)
    if a.launch:
        rows = []
        for b in [int(x) for x in a.batches.split(",")]:
            for row in launch_costs(model, b, a.tokens, spec):
                print(f"== batch {b} {row}", flush=True)
                rows.append({"batch": b, **row})
        write_results(out / "launch.json", {**run_header("step_trace_launch", torch.cuda.get_device_name()),
                                            "drafter_dtype": a.drafter_dtype, "rows": rows})
        return
    for b in [int(x) for x in a.batches.split(",")]:
        for tag, sp, overlap in (("plain", None, False), ("drafter", spec, False), ("drafter_overlap", spec, True)):
            summary = trace_run(model, b, a.tokens, sp, overlap, out, f"b{b}_{tag}")
            print(f"== batch {b} {tag}: {summary}", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
