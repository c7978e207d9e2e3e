"""Where a decode step's time goes on the GPU (stdout only, no results JSON): the K3-width model of
benchmarks/spec_decode.py (random weights), plain decoding and a batched chain-3 speculative step at the given
batches (the speculative step always drafts 3 tokens, `FullDrafts`): first the wall ms per step of every
configuration, eager and with the decode forwards as CUDA graphs (k3.rollout.graphs), then torch.profiler over
eager runs of `--tokens` and of one token -- the decode steps' device kernel time (the difference; against the
wall time: is the step host-bound?), the kernels by device time, the host ops by own time (`--stacks`: by Python
call site). The timings come first: once the profiler has run in a process, its launches stay slower (they
measured 2x). `--phases`: the speculative step's phases instead.

    . benchmarks/device_env.sh && python3 -m benchmarks.decode_profile --batches 8 --spec > $OUT/profile.txt

(write to a file, not through a pipe that buffers until the end: a call cut off at its limit keeps what was
printed.)
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.k3_width import k3_width_model
from benchmarks.spec_decode import _DecodeTimer, bench_engine, step_phases
from k3.rollout import SamplingParams
from k3.rollout.spec import SpecConfig


def _prompts(n):
    from k3.envs import CalculatorEnv
    from k3.envs.calc_task import heldout_tasks
    env = CalculatorEnv()
    return [env.prompt(t) for t in heldout_tasks()][:n]


class FullDrafts:
    """Always drafts k tokens (the last token repeated): every verify step runs at its full width, whatever the
    random target accepts, so the step's cost is the chain's."""

    def propose(self, context, k):
        return [context[-1]] * k


def _engine(model, batch: int, spec: SpecConfig | None, graphs: bool = True):
    """An engine at decode batch `batch` (CUDA graphs on or off) and its _DecodeTimer."""
    eng = bench_engine(model, spec, batch, cuda_graphs=graphs)
    if spec is not None:
        eng.spec.drafter = FullDrafts()
    return _DecodeTimer(eng), eng


def _run(model, batch: int, spec: SpecConfig | None, max_tokens: int, graphs: bool = True, reuse=None):
    """One greedy run of `batch` held-out prompts at decode batch `batch` -> (its _DecodeTimer, counting this run
    only, and the engine). `reuse`: the (timer, engine) of an earlier run (its graphs are captured)."""
    timer, eng = reuse if reuse is not None else _engine(model, batch, spec, graphs)
    timer.reset()
    eng.generate(_prompts(batch), SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return timer, eng


def _steps(timer, batch: int, spec: SpecConfig | None, tokens: int) -> float:
    return timer.counted("spec_verifies") / max(batch, 1) if spec is not None else tokens - 1


def time_decode(model, batch: int, spec: SpecConfig | None, tokens: int, graphs: bool = True) -> None:
    """Wall ms per decode step, on the second run of one engine (the first builds the kernels and captures the
    graphs). Run before any profiler session in the process: launches stay slower after one (CUPTI)."""
    timer, eng = _run(model, batch, spec, tokens, graphs)
    timer, eng = _run(model, batch, spec, tokens, reuse=(timer, eng))
    n = timer.counted("spec_emitted_tokens") if spec is not None else timer.tokens
    captured = f", {eng.graphs.stats['captures']} graphs" if eng.graphs is not None else ", eager"
    print(f"== batch {batch} spec {spec and spec.shape}{captured}: decode {timer.seconds * 1e3:.1f} ms for {n} "
          f"tokens, {timer.seconds / max(_steps(timer, batch, spec, tokens), 1) * 1e3:.2f} ms per step", flush=True)


def profile_decode(model, batch: int, spec: SpecConfig | None, tokens: int, stacks: bool = False) -> None:
    """torch.profiler over a run of `tokens` and a run of one: the decode steps' device kernel time (the
    difference), the kernels by device time, the host ops by own time (`stacks`: by Python call site)."""
    def profiled(max_tokens):
        verbose = torch._C._profiler._ExperimentalConfig(verbose=True) if stacks else None   # Python call sites
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA], with_stack=stacks,
                                    experimental_config=verbose) as tp:
            _run(model, batch, spec, max_tokens, graphs=False)
            torch.cuda.synchronize()
        events = tp.key_averages()
        kernel_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in events
                        if e.device_type == torch.autograd.DeviceType.CUDA)
        stack_table = (tp.key_averages(group_by_stack_n=4).table(sort_by="self_cpu_time_total", row_limit=25,
                                                                 max_name_column_width=60) if stacks else None)
        return events, kernel_us, stack_table
    _run(model, batch, spec, tokens, graphs=False)   # kernel builds
    _, prefill_us, _ = profiled(1)
    events, all_us, stack_table = profiled(tokens)
    print(f"== batch {batch} spec {spec and spec.shape}: device kernel time of the decode steps (run of {tokens} "
          f"tokens less a run of 1): {(all_us - prefill_us) / 1e3:.1f} ms (wall time: the timing lines above)",
          flush=True)
    sort = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    print(events.table(sort_by=sort, row_limit=15), flush=True)
    print(events.table(sort_by="self_cpu_time_total", row_limit=20), flush=True)
    if stack_table is not None:
        print(stack_table, flush=True)


def spec_phases(model, batch: int, tokens: int) -> None:
    """Wall time of each phase of the batched chain-3 speculative step (`spec_decode.step_phases`: the device
    synchronised around each, so a phase's figure includes its device work), every step drafting 3 tokens
    (FullDrafts). Prints ms per step."""
    def full_drafts(eng):
        eng.spec.drafter = FullDrafts()
    phases = step_phases(model, _prompts(batch), SamplingParams(temperature=0.0, max_tokens=tokens),
                         SpecConfig(draft_len=3, verify="batched"), batch, None, setup=full_drafts)
    print(f"== phases, batch {batch}: {phases}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="8")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--spec", action="store_true", help="also a batched chain-3 step at each batch")
    ap.add_argument("--phases", action="store_true", help="only the speculative step's phases (spec_phases)")
    ap.add_argument("--stacks", action="store_true", help="also the host ops grouped by their Python call sites")
    ap.add_argument("--no-profile", action="store_true", help="the timings only")
    a = ap.parse_args()
    model = k3_width_model()
    batches = [int(x) for x in a.batches.split(",")]
    specs = [None] + ([SpecConfig(draft_len=3, verify="batched")] if a.spec else [])
    if a.phases:
        for b in batches:
            spec_phases(model, b, a.tokens)
        return
    for b in batches:   # every timing before the first profiler session
        for spec in specs:
            for graphs in (False, True):
                time_decode(model, b, spec, a.tokens, graphs)
    if a.no_profile:
        return
    for b in batches:
        for spec in specs:
            profile_decode(model, b, spec, a.tokens, a.stacks)


if __name__ == "__main__":
    main()
