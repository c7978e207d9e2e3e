"""What one decode step of the embedded engine launches: aten ops (by op and by the module that issued them), the
ops that make the host wait for the device, and on CUDA the kernel launches and the step's wall time.

Why: on the H200 the serverless load test and plain decoding showed an engine step costing about the same whatever
it holds (k3/serverless/NOTES.md): the step is host-bound, so the number of launches and host syncs per step is the
figure to drive down (and what a CUDA-graphed decode step would remove). Counting ops needs no GPU: the engine's
own Python (sampling, pages, cache bookkeeping) issues the same ops on either device; the model's CPU path issues
torch ops where CUDA runs Triton kernels, so the model's share differs by device -- run it on both.

One decode step = the difference between `generate(max_tokens=2)` and `generate(max_tokens=1)` on fresh engines
(same prompts, prefix cache off): everything but the second token's decode cancels.

    python -m benchmarks.engine_ops --preset tiny                 # CPU -> engine_ops_cpu.json
    python -m benchmarks.engine_ops --preset small --device cuda  # H200 -> engine_ops_h200.json
    ... --rows 4,32,64 --decode-batch 64                          # also how the step grows with its rows
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time
from dataclasses import dataclass, replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks._results import run_header, write_results
from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.rollout import Engine, SamplingParams

# ops after which the host has to wait for the device (data-dependent shapes, values read on the host)
HOST_SYNC_OPS = ("aten.nonzero", "aten.nonzero_numpy", "aten._local_scalar_dense", "aten.masked_select", "aten.unique",
                 "aten._unique2", "aten.repeat_interleave")
# ops that only re-describe a tensor (no kernel on any device)
VIEW_OPS = ("aten.view", "aten.reshape", "aten._unsafe_view", "aten.slice", "aten.select", "aten.unsqueeze",
            "aten.squeeze", "aten.t", "aten.transpose", "aten.expand", "aten.permute", "aten.as_strided",
            "aten.alias", "aten.detach", "aten.lift_fresh", "aten.split", "aten.unbind", "aten.chunk")


@dataclass(frozen=True)
class OpsConfig:
    preset: str = "tiny"
    device: str = "cpu"
    rows: int = 4               # prompts decoded together
    decode_batch: int = 8       # the engine's fixed decode batch
    prompt_len: int = 8
    timed_tokens: int = 33      # tokens of the timed generate (CUDA only)
    repeats: int = 5


class _Counter(TorchDispatchMode):
    """Counts every aten op, under the innermost model module running (module hooks keep the stack)."""

    def __init__(self, stack: list[str]):
        super().__init__()
        self.stack = stack
        self.ops: collections.Counter = collections.Counter()
        self.by_module: collections.Counter = collections.Counter()
        self.to_host = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        self.ops[name] += 1
        if name not in VIEW_OPS:
            self.by_module[self.stack[-1] if self.stack else "engine (outside the model)"] += 1
        out = func(*args, **kwargs)
        if name in ("aten._to_copy", "aten.to", "aten.copy_") and isinstance(out, torch.Tensor) and (
                out.device.type == "cpu" and any(isinstance(a, torch.Tensor) and a.device.type != "cpu"
                                                 for a in args)):
            self.to_host += 1
        return out


def _module_stack(model: torch.nn.Module) -> tuple[list[str], list]:
    stack: list[str] = []
    handles = []
    for mod in model.modules():
        handles.append(mod.register_forward_pre_hook(lambda m, a: stack.append(type(m).__name__)))
        handles.append(mod.register_forward_hook(lambda m, a, o: stack.pop() and None))   # None: output kept
    return stack, handles


def _prompts(cfg: OpsConfig, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, min(1000, vocab), (cfg.prompt_len,), generator=g).tolist() for _ in range(cfg.rows)]


def _engine(model, cfg: OpsConfig) -> Engine:
    return Engine(model, prefix_cache=False, decode_batch=cfg.decode_batch, max_running=max(32, cfg.rows))


def _count(model, cfg: OpsConfig, prompts, max_tokens: int) -> _Counter:
    stack, handles = _module_stack(model)
    try:
        eng = _engine(model, cfg)
        with _Counter(stack) as c:
            eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    finally:
        for h in handles:
            h.remove()
    return c


def _kernel_launches(model, cfg: OpsConfig, prompts, max_tokens: int) -> int:
    from torch.profiler import ProfilerActivity, profile
    eng = _engine(model, cfg)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                   "cuLaunchKernelEx", "cudaLaunchKernelExC"))


def decode_step_ops(model: K3ForCausalLM, cfg: OpsConfig) -> dict:
    prompts = _prompts(cfg, model.config.vocab_size)
    _engine(model, cfg).generate(prompts, SamplingParams(temperature=0.0, max_tokens=2))   # warm-up (builds)
    one, two = _count(model, cfg, prompts, 1), _count(model, cfg, prompts, 2)
    ops = two.ops.copy()
    ops.subtract(one.ops)
    by_module = two.by_module.copy()
    by_module.subtract(one.by_module)
    total = sum(ops.values())
    views = sum(v for k, v in ops.items() if k in VIEW_OPS)
    out = {"aten_ops": total, "aten_ops_not_views": total - views,
           "host_sync_ops": {k: ops[k] for k in HOST_SYNC_OPS if ops[k]},
           "device_to_host_copies": two.to_host - one.to_host,
           "top_ops": dict(ops.most_common(25)),
           "ops_by_module_not_views": dict(by_module.most_common())}
    if cfg.device == "cuda":
        out["kernel_launches"] = (_kernel_launches(model, cfg, prompts, 2)
                                  - _kernel_launches(model, cfg, prompts, 1))
        times = []
        for _ in range(cfg.repeats):
            runs = {}
            for n in (1, cfg.timed_tokens):
                eng = _engine(model, cfg)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n))
                torch.cuda.synchronize()
                runs[n] = time.perf_counter() - t0
            times.append((runs[cfg.timed_tokens] - runs[1]) / (cfg.timed_tokens - 1))
        out["decode_step_s_median"] = statistics.median(times)
        out["decode_step_s_all"] = times
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default=OpsConfig.preset)
    ap.add_argument("--device", default=OpsConfig.device, choices=("cpu", "cuda"))
    ap.add_argument("--rows", default=str(OpsConfig.rows),
                    help="prompts decoded together; a comma list also records each count's step (by_rows)")
    ap.add_argument("--decode-batch", type=int, default=OpsConfig.decode_batch)
    ap.add_argument("--repeats", type=int, default=OpsConfig.repeats,
                    help="timed generates per row count on CUDA (each ~34 engine steps)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    if max(rows) > a.decode_batch:
        ap.error(f"--rows {max(rows)} is over --decode-batch {a.decode_batch} (one decode wave per step)")
    cfg = OpsConfig(preset=a.preset, device=a.device, rows=rows[0], decode_batch=a.decode_batch, repeats=a.repeats)
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset(cfg.preset)).to(cfg.device).eval()
    if cfg.device == "cuda":
        model = model.bfloat16()
    res = {**run_header("engine_ops", torch.cuda.get_device_name() if cfg.device == "cuda" else "cpu"),
           "config": cfg.__dict__, "decode_step": decode_step_ops(model, cfg)}
    if len(rows) > 1:   # the same step at other row counts: what grows with the rows is per-row host work
        keep = ("aten_ops", "aten_ops_not_views", "host_sync_ops", "device_to_host_copies", "kernel_launches",
                "decode_step_s_median")
        res["by_rows"] = {}
        for n in rows:
            one = res["decode_step"] if n == rows[0] else decode_step_ops(model, replace(cfg, rows=n))
            res["by_rows"][str(n)] = {k: one[k] for k in keep if k in one} | {
                "engine_ops_not_views": one["ops_by_module_not_views"].get("engine (outside the model)", 0)}
            print(f"rows {n}: {res['by_rows'][str(n)]}")
    step = res["decode_step"]
    print(f"one decode step ({cfg.preset}, {cfg.device}, {cfg.rows} rows, decode_batch {cfg.decode_batch}): "
          f"{step['aten_ops']} aten ops ({step['aten_ops_not_views']} not views), host syncs "
          f"{step['host_sync_ops']}, device->host copies {step['device_to_host_copies']}"
          + (f", {step['kernel_launches']} kernel launches, {step['decode_step_s_median'] * 1e3:.1f} ms"
             if cfg.device == "cuda" else ""))
    for k, v in list(step["ops_by_module_not_views"].items())[:12]:
        print(f"  {v:6d}  {k}")
    print(f"wrote {write_results(a.out or ('engine_ops_h200' if cfg.device == 'cuda' else 'engine_ops_cpu'), res)}")


if __name__ == "__main__":
    main()
