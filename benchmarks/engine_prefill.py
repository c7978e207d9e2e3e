"""Batched prefill in the embedded engine (`EngineConfig.prefill_batch`): many prompts arriving at once, as in the
serverless service's merged sample rounds, with prefill_batch 1 (one row per prefill forward) against P (segments
at one position and length share forwards of P rows), side by side in one process: forwards, wall time of the
whole generate, and whether a prompt's completion is bitwise the same alone and among the others (batch
invariance at that setting).

    python -m benchmarks.engine_prefill                                  # CPU, tiny -> engine_prefill_cpu.json
    python -m benchmarks.engine_prefill --device cuda --preset small     # H200 -> engine_prefill_h200.json
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from benchmarks._results import run_header, write_results
from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.rollout import Engine, SamplingParams


@dataclass(frozen=True)
class PrefillConfig:
    preset: str = "tiny"
    device: str = "cpu"
    prompts: int = 16
    system_len: int = 200      # shared by every prompt (computed once per prompt: no prefix cache here)
    task_len: int = 40
    samples: int = 4
    max_tokens: int = 8
    prefill_batch: int = 8
    decode_batch: int = 64
    repeats: int = 3


def _prompts(cfg: PrefillConfig, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    system = torch.randint(3, min(1000, vocab), (cfg.system_len,), generator=g).tolist()
    return [system + torch.randint(3, min(1000, vocab), (cfg.task_len,), generator=g).tolist()
            for _ in range(cfg.prompts)]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run(model: K3ForCausalLM, cfg: PrefillConfig) -> dict:
    prompts = _prompts(cfg, model.config.vocab_size)
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=cfg.max_tokens, n=cfg.samples)
    settings = {"prefill_batch_1": 1, f"prefill_batch_{cfg.prefill_batch}": cfg.prefill_batch}
    rows = {}
    for name, pb in settings.items():
        def engine():
            return Engine(model, prefix_cache=False, decode_batch=cfg.decode_batch, prefill_batch=pb,
                          max_running=cfg.prompts * cfg.samples, max_step_tokens=4096)
        engine().generate(prompts[:2], sp)   # warm-up (compiles)
        times, forwards, out = [], 0, None
        for _ in range(cfg.repeats):
            eng = engine()
            _sync(cfg.device)
            t0 = time.perf_counter()
            out = eng.generate(prompts, sp)
            _sync(cfg.device)
            times.append(time.perf_counter() - t0)
            forwards = eng.cache_stats()["forwards"]
        alone = engine().generate([prompts[cfg.prompts // 2]], sp)
        mixed = out[cfg.prompts // 2 * cfg.samples:(cfg.prompts // 2 + 1) * cfg.samples]
        rows[name] = {"forwards": forwards, "generate_s_median": statistics.median(times), "generate_s_all": times,
                      "alone_equals_mixed_bitwise": all(a.token_ids == b.token_ids and a.logprobs == b.logprobs
                                                        for a, b in zip(alone, mixed))}
    first, second = rows.values()
    return {"rows": rows, "speedup": first["generate_s_median"] / second["generate_s_median"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default=PrefillConfig.preset)
    ap.add_argument("--device", default=PrefillConfig.device, choices=("cpu", "cuda"))
    ap.add_argument("--prompts", type=int, default=PrefillConfig.prompts)
    ap.add_argument("--prefill-batch", type=int, default=PrefillConfig.prefill_batch)
    ap.add_argument("--repeats", type=int, default=PrefillConfig.repeats)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cfg = PrefillConfig(preset=a.preset, device=a.device, prompts=a.prompts, prefill_batch=a.prefill_batch,
                        repeats=a.repeats)
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset(cfg.preset)).to(cfg.device).eval()
    if cfg.device == "cuda":
        model = model.bfloat16()
    res = {**run_header("engine_prefill", torch.cuda.get_device_name() if cfg.device == "cuda" else "cpu"),
           "config": cfg.__dict__, **run(model, cfg)}
    for name, r in res["rows"].items():
        print(f"{name}: {r['forwards']} forwards, {r['generate_s_median']:.3f} s, "
              f"alone == mixed: {r['alone_equals_mixed_bitwise']}")
    print(f"speedup {res['speedup']:.2f}x")
    name = a.out or ("engine_prefill_h200" if cfg.device == "cuda" else "engine_prefill_cpu")
    print(f"wrote {write_results(name, res)}")


if __name__ == "__main__":
    main()
