"""Prefix-cache hit rates inside SGLang: its `UnifiedRadixCache` vs ours (`K3RadixCache`, --radix-cache-backend k3),
both on the same pools of SGLang's unified-radix-cache kit (FULL + MAMBA, page size 1: KDA states in the Mamba pool),
replaying the same traces like the scheduler does (k3_sglang.radix_replay), at equal state memory: the same number of
state slots (`mamba_cache_size`) for both, KV slots ample so that states are what runs short.

Workloads:
1. main_job: one update's rollouts of the calculator GSPO job (examples/calculator_gspo.toml; k3.jobs.episodes on the
   SFT base, multi-turn with tool calls, G samples per task), recorded from the project's engine; a request is its
   episode's final turn when no later request resumes it.
2. long_multiturn: benchmarks/prefix_cache.py's long trace shape (8000-token system prompt, 12 turns of 300-1500
   generated tokens and 20-200 tool tokens), 2 tasks x 4 samples (LONG_HERE).
3. long_multiturn_two_adapters: the same trace with the samples split over two LoRA adapters trained side by side
   (serverless multi-LoRA): adapter A is updated after waves 3, 7, 11 and adapter B after waves 5 and 9; SGLang
   flushes its cache on each update (what update_weights does), ours moves the updated adapter's scope only.
Reported per workload and state budget: prompt-token hit rate, tokens recomputed at turn resumes, evict calls.
Every hit is checked to hold the request's tokens as computed by the request's policy version (KV marks).
Runs in .venv-sglang. Writes benchmarks/results/sglang_radix.json.
"""
from __future__ import annotations

import argparse
import time

import benchmarks._sglang_cpu  # noqa: F401  (before SGLang)
from benchmarks._results import run_header, write_results

BUDGETS = (4096, 96, 48, 12, 8)   # state slots (mamba_cache_size), the same for both caches


def record_main_job(config: str) -> list[list[dict]]:
    """Waves of requests (one `generate` call each) from one update's rollouts of the main job."""
    import torch

    from k3.envs import CalculatorEnv, train_tasks
    from k3.jobs.config import load_config
    from k3.jobs.episodes import run_episodes
    from k3.jobs.sft import ensure_base
    from k3.model import K3ForCausalLM
    from k3.rollout import Engine

    cfg = load_config(config)
    base, _ = ensure_base(cfg, progress=False)
    model = K3ForCausalLM.from_pretrained(base).eval()
    r = cfg.rollout
    eng = Engine(model, prefix_cache=True, checkpoint_interval=r.checkpoint_every, device_states=r.state_slots,
                 host_states=r.state_slots, device_pages=r.kv_pages, host_pages=r.kv_pages)
    waves: list[list[dict]] = []

    class Recorder:
        def generate(self, prompts, sampling):
            out = eng.generate(prompts, sampling)
            waves.append([{"prompt": list(c.prompt), "gen": list(c.token_ids)} for c in out])
            return out

    with torch.inference_mode():
        run_episodes(Recorder(), CalculatorEnv(), train_tasks(cfg.rl.train_seed * 1000 + 1, r.tasks_per_update),
                     r.group_size, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                     max_turn_tokens=r.max_turn_tokens, seed=cfg.rl.train_seed * 7919 + 1)
    later = [tuple(q["prompt"]) for w in waves for q in w]
    for t, w in enumerate(waves):
        for q in w:
            done = q["prompt"] + q["gen"][:-1]
            q["final_turn"] = not any(len(p) > len(done) and list(p[:len(done)]) == done
                                      for p in later[sum(len(x) for x in waves[:t + 1]):])
            q["resume_len"] = 0
            q["extra_key"] = None
    for t in range(1, len(waves)):        # resume length: what the previous turn of the episode computed
        prev = [q["prompt"] + q["gen"][:-1] for q in waves[t - 1]]
        for q in waves[t]:
            q["resume_len"] = max((len(p) for p in prev if q["prompt"][:len(p)] == p), default=0)
    return waves


# benchmarks/prefix_cache.py's LONG shape, fewer tasks and samples (the replay drives SGLang's Python tree: the full
# trace takes ~10 min per run on this box)
LONG_HERE = dict(system=8000, tasks=2, G=4, turns=12, task_len=(200, 600), gen_len=(300, 1500), tool_len=(20, 200))


def long_trace(two_adapters: bool) -> tuple[list[list[dict]], dict[int, list[str]]]:
    from benchmarks.prefix_cache import make_trace

    waves = []
    for w in make_trace(0, **LONG_HERE):
        rows = []
        for r in w:
            rows.append({"prompt": list(r.prompt), "gen": list(r.gen), "resume_len": r.parent_len,
                         "final_turn": False,
                         "extra_key": (("lora-a", "lora-b")[r.sample % 2]) if two_adapters else None})
        waves.append(rows)
    for r in waves[-1]:
        r["final_turn"] = True
    updates = {3: ["lora-a"], 5: ["lora-b"], 7: ["lora-a"], 9: ["lora-b"], 11: ["lora-a"]} if two_adapters else {}
    return waves, updates


def replay(waves, updates: dict[int, list[str]], backend: str, budget: int, verify: bool) -> dict:
    import torch
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.test.kits.unified_radix_cache.config import CacheConfig

    from k3_sglang.radix_replay import CacheDriver

    total = sum(len(q["prompt"]) + len(q["gen"]) for w in waves for q in w)
    longest = max(len(q["prompt"]) + len(q["gen"]) for w in waves for q in w)
    cfg = CacheConfig(page_size=1, components=(ComponentType.FULL, ComponentType.MAMBA), kv_size=total + 64,
                      max_context_len=longest + 64, mamba_cache_size=budget, max_num_reqs=4, head_num=1,
                      head_dim=8, dtype=torch.float32)
    d = CacheDriver(cfg, backend, verify_prefix=verify)
    t0 = time.perf_counter()
    for t, wave in enumerate(waves):
        for key in updates.get(t, []):
            d.update_weights(key, sglang_flush=True)
        for q in wave:
            d.serve([x % (1 << 24) for x in q["prompt"]], [x % (1 << 24) for x in q["gen"]],
                    extra_key=q["extra_key"], final_turn=q["final_turn"], resume_len=q["resume_len"])
    out = d.stats.summary() | {"replay_wall_s": time.perf_counter() - t0}
    print(f"  {backend:7s} states {budget:5d}: hit rate {out['hit_rate']:.4f} ({out['replay_wall_s']:.0f} s)", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job-config", default="examples/calculator_gspo.toml")
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    ap.add_argument("--no-verify", action="store_true", help="skip the per-hit KV mark check (faster)")
    ap.add_argument("--main-job-only", action="store_true")
    ap.add_argument("--out", default="sglang_radix")
    args = ap.parse_args()
    budgets = [int(x) for x in args.budgets.split(",")]
    workloads = {"main_job": (record_main_job(args.job_config), {})}
    if not args.main_job_only:
        workloads |= {"long_multiturn": long_trace(False), "long_multiturn_two_adapters": long_trace(True)}
    result = {**run_header("sglang_radix", device="cpu", packages=("sglang",)),
              "cache_config": "kit CacheConfig FULL+MAMBA, page_size 1, KV ample, mamba_cache_size = budget",
              "verified_prefixes": not args.no_verify, "workloads": {}}
    for name, (waves, updates) in workloads.items():
        print(name, flush=True)
        reqs = [q for w in waves for q in w]
        row = {"requests": len(reqs), "waves": len(waves), "prompt_tokens": sum(len(q["prompt"]) for q in reqs),
               "final_turn_requests": sum(q["final_turn"] for q in reqs),
               "weight_updates": {str(k): v for k, v in updates.items()}, "budgets": {}}
        for b in budgets:
            row["budgets"][str(b)] = {be: replay(waves, updates, be, b, not args.no_verify)
                                      for be in ("sglang", "k3")}
        result["workloads"][name] = row
    path = write_results(args.out, result)
    print(f"{'workload':28s}{'states':>7s}{'sglang hit':>11s}{'k3 hit':>8s}{'sglang resume recomp':>21s}"
          f"{'k3 resume recomp':>17s}")
    for name, row in result["workloads"].items():
        for b, r in row["budgets"].items():
            s, k = r["sglang"], r["k3"]
            print(f"{name:28s}{b:>7s}{s['hit_rate']:11.4f}{k['hit_rate']:8.4f}{s['resume_recomputed_tokens']:21d}"
                  f"{k['resume_recomputed_tokens']:17d}")
    print("wrote", path)


if __name__ == "__main__":
    main()
