"""Prefix caching for RL rollouts on the hybrid MLA+KDA model: ours vs SGLang-like vs vLLM-like policies.

1. A generator of RL rollout traces: one long shared system prompt, tasks with G samples each, T turns alternating
   model generation and tool outputs of random lengths (contexts grow long). Requests arrive turn by turn, the G
   samples of a task together.
2. The same trace replayed through four checkpoint policies implemented on the same radix tree (k3.rollout.radix):
   - ours: keys carry the segment structure (bitwise-exact reuse); KDA checkpoints at every prompt end (with its
     logits: n samples and repeated prompts hit fully), at every turn end (resumes recompute nothing), at the
     branch point as soon as a request diverges from a cached path, and every 256 tokens;
   - ours_no_interval: the same without the every-256-token checkpoints;
   - SGLang-like (UnifiedRadixCache extra_buffer): one checkpoint per extend at its last 64-aligned point, decode
     checkpoints every 256 tokens, on finish only the last tracked state is kept (the KV key is truncated to it),
     branch points planted only when a second sibling arrives; a hit must leave >= 1 token to compute;
   - vLLM-like align mode: states only at block boundaries (block = 528 tokens), hit = last cached boundary.
   Reported: prompt-token hit rate, tokens recomputed at turn resumes, KDA states held and their memory at the
   full K3 config, first with no eviction (unlimited memory for every policy: ours then holds ~3x the states),
   then at EQUAL state memory: the same budget of states for all four (1, 0.5, 0.25 x what the SGLang-like
   policy holds unlimited), LRU eviction over states for all, interior nodes before leaves (the engine's
   state-pool reclaim), so that the policies differ only in where they checkpoint.
3. The real engine (tiny preset, CPU) on a small trace of the same shape, prefix cache on vs off: wall time,
   tokens/s (median of runs) and a bitwise comparison of the outputs.
Writes benchmarks/results/prefix_cache.json (`--replay-only`: 2 only, the engine section carried over).
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks._results import RESULTS, run_header, write_results
from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.rollout import Engine, Prompt, SamplingParams
from k3.rollout.radix import RadixTree
from k3.rollout.types import KIND_PREFILL_END, key_kind, key_len

CHUNK, CKPT = 64, 256


# ---------------------------------------------------------------------- traces
@dataclass
class Req:
    prompt: Prompt          # tokens + span structure
    gen: list[int]          # tokens this turn generates
    parent_len: int         # tokens the previous turn computed (0 for a first turn)
    sample: int             # global sample id (for bookkeeping)
    fresh: int              # prompt tokens never seen before in the trace (no cache can hit them)


def make_trace(seed: int, system: int, tasks: int, G: int, turns: int, task_len: tuple[int, int],
               gen_len: tuple[int, int], tool_len: tuple[int, int], vocab: int = 160000) -> list[list[Req]]:
    """Waves of requests: wave t holds turn t of every sample (first-turn prompts identical within a task)."""
    rnd = random.Random(seed)
    tok = lambda n: [rnd.randrange(3, vocab) for _ in range(n)]
    sys_prompt = tok(system)
    waves: list[list[Req]] = [[] for _ in range(turns)]
    sid = 0
    for task in range(tasks):
        first = sys_prompt + tok(rnd.randint(*task_len))
        for g in range(G):
            prompt = Prompt(first, [(system, "prefill"), (len(first) - system, "prefill")])
            for t in range(turns):
                gen = tok(rnd.randint(*gen_len))
                fresh = (len(first) - system + (system if task == 0 else 0)) * (g == 0) if t == 0 else \
                    len(prompt) - prompt.parent_len
                waves[t].append(Req(prompt, gen, prompt.parent_len, sid, fresh))
                tool = tok(rnd.randint(*tool_len))
                spans = list(prompt.spans) + ([(len(gen) - 1, "decode")] if len(gen) > 1 else []) + \
                    [(1 + len(tool), "prefill")]
                prompt = Prompt(list(prompt) + gen + tool, spans, parent_len=len(prompt) + len(gen) - 1)
            sid += 1
    return waves


# ---------------------------------------------------------------------- policies on one tree
class Policy:
    """Replays requests on a RadixTree holding integer state ids; counts states held.

    `state_budget` (None: unlimited) caps the KDA states held. Eviction is the same for every policy and is the
    engine's (k3.rollout.engine `_reclaim` on the state pool): before a new checkpoint would exceed the budget, the
    least recently used state of an interior node is dropped, or of a leaf when no interior node holds one
    (`tree.lru` + `tree.drop_state`: its node stays as a path unless it is a leaf, whose pages then go too). A checkpoint the tree already holds takes no budget.
    Policies differ only in where they checkpoint (their `run`)."""
    name = ""

    def __init__(self, state_budget: int | None = None):
        if state_budget is not None and state_budget < 1:
            raise ValueError(f"state_budget: {state_budget} (must be >= 1 or None)")
        self.tree = RadixTree(1, release_state=self._release)
        self.budget = state_budget
        self.live_states = 0
        self.peak_states = 0
        self.next_state = 0
        self.evicted_states = 0
        self.stats = {"prompt_tokens": 0, "hit_tokens": 0, "resume_tokens": 0, "resume_recomputed": 0,
                      "computed_prompt_tokens": 0, "requests": 0, "fresh_tokens": 0}

    def _release(self, s: int) -> None:
        self.live_states -= 1

    def _state(self) -> int:
        self.live_states += 1
        self.peak_states = max(self.peak_states, self.live_states)
        self.next_state += 1
        return self.next_state

    def _make_room(self) -> None:
        while self.live_states >= self.budget:
            victim = self.tree.lru(lambda n: n.state is not None and bool(n.children)) or \
                self.tree.lru(lambda n: n.state is not None)
            self.tree.drop_state(victim)
            self.evicted_states += 1

    def insert(self, key: list[int], upto: int, extra=None) -> None:
        if upto <= 0:
            return
        if self.budget is not None:
            held = self.tree.match("s", key[:upto], usable=lambda n: n.end == upto).node is not None
            if held:           # already checkpointed here: nothing new to hold (the insert refreshes its LRU time)
                self.tree.insert("s", key[:upto], list(range(upto)), extra=extra)
                return
            self._make_room()
        self.tree.insert("s", key[:upto], list(range(upto)), state=self._state(), extra=extra)

    def record(self, r: Req, L: int, hit: int) -> None:
        s = self.stats
        s["requests"] += 1
        s["prompt_tokens"] += L
        s["hit_tokens"] += hit
        s["computed_prompt_tokens"] += L - hit
        s["fresh_tokens"] += r.fresh
        if r.parent_len:
            s["resume_tokens"] += r.parent_len
            s["resume_recomputed"] += max(0, r.parent_len - hit)


class Ours(Policy):
    name = "ours"
    interval = CKPT

    def run(self, r: Req) -> None:
        full = Prompt(list(r.prompt) + r.gen[:-1], list(r.prompt.spans) + [(len(r.gen) - 1, "decode")])
        key = full.key(CHUNK)
        L = len(r.prompt)
        m = self.tree.match("s", key[:L], usable=lambda n: n.end < L or n.extra is not None)
        hit = m.hit
        self.record(r, L, hit)
        # segment ends reached while computing [hit, end): checkpoints at prompt ends, every CKPT, branch point
        branch = 0
        if hit < m.prefix < L:
            pos = 0
            while pos + key_len(key[pos]) <= m.prefix:
                pos += key_len(key[pos])
            branch = pos if pos > hit else 0
        pos = hit
        while pos < len(key):
            pos += key_len(key[pos])
            if key_kind(key[pos - 1]) == KIND_PREFILL_END or (self.interval and pos % self.interval == 0) \
                    or pos == branch:
                self.insert(key, pos, extra=True if key_kind(key[pos - 1]) == KIND_PREFILL_END else None)
        self.insert(key, len(key))   # turn end


class OursNoInterval(Ours):
    """Ours without the every-256-token checkpoints (prompt ends, turn ends and branch points only): under a state
    budget, the interval checkpoints a recomputation plants compete with the turn ends that resumes need."""
    name = "ours_no_interval"
    interval = 0


class SGLangLike(Policy):
    name = "sglang_like"
    grid, track = 64, 256

    def run(self, r: Req) -> None:
        toks = list(r.prompt) + r.gen[:-1]
        L = len(r.prompt)
        m = self.tree.match("s", toks[:L - 1])     # >= 1 token left to compute
        hit = m.hit
        self.record(r, L, hit)
        if m.prefix > hit:                         # a second sibling plants the branch checkpoint
            b = m.prefix // self.grid * self.grid
            if b > hit:
                self.insert(toks, b)
        last = L // self.grid * self.grid          # one snapshot per extend, at its last grid point
        if last > max(hit, 0):
            self.insert(toks, last)
        tracked = last
        for p in range(L + self.track, len(toks) + 1, self.track):   # decode tracking
            tracked = p
        if tracked > last:
            self.insert(toks, tracked)             # on finish only the last tracked state is kept


class VLLMAlign(Policy):
    name = "vllm_like_align"
    block = 528

    def run(self, r: Req) -> None:
        toks = list(r.prompt) + r.gen[:-1]
        L = len(r.prompt)
        m = self.tree.match("s", toks[:L - 1])
        hit = m.hit
        self.record(r, L, hit)
        for p in range((hit // self.block + 1) * self.block, len(toks) + 1, self.block):
            self.insert(toks, p)


def state_bytes_k3() -> int:
    cfg = K3Config.preset("k3")
    n_kda = sum(cfg.is_kda_layer(i) for i in range(cfg.num_hidden_layers))
    H, K, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel_size
    return n_kda * (H * K * K * 4 + 3 * H * K * (W - 1) * 2)   # fp32 recurrent + bf16 conv windows


POLICIES = (Ours, OursNoInterval, SGLangLike, VLLMAlign)


def replay(waves: list[list[Req]], state_budget: int | None = None) -> dict:
    """Every policy on the same trace; `state_budget` states at most each (None: unlimited, no eviction)."""
    out = {}
    sb = state_bytes_k3()
    for cls in POLICIES:
        pol = cls(state_budget)
        for wave in waves:
            for r in wave:
                pol.run(r)
            pol.tree.check()
        s = pol.stats
        out[pol.name] = {
            "prompt_token_hit_rate": s["hit_tokens"] / s["prompt_tokens"],
            "ideal_hit_rate": 1 - s["fresh_tokens"] / s["prompt_tokens"],
            "resume_recomputed_tokens": s["resume_recomputed"],
            "resume_tokens": s["resume_tokens"],
            "computed_prompt_tokens": s["computed_prompt_tokens"],
            "prompt_tokens": s["prompt_tokens"],
            "states_held_final": pol.live_states,
            "states_held_peak": pol.peak_states,
            "state_memory_gib_peak_k3": pol.peak_states * sb / 2 ** 30,
        }
        if state_budget is not None:
            out[pol.name]["state_budget"] = state_budget
            out[pol.name]["states_evicted"] = pol.evicted_states
    return out


def equal_memory(waves: list[list[Req]], unlimited: dict, fractions=(1.0, 0.5, 0.25)) -> dict:
    """The policies at the same state budgets: `fractions` of the states the SGLang-like policy holds with no
    eviction (its peak on this trace), LRU eviction on for all three."""
    base = unlimited["sglang_like"]["states_held_peak"]
    runs = []
    for f in fractions:
        budget = max(1, round(base * f))
        runs.append({"budget_states": budget, "budget_fraction_of_sglang_like_peak": f,
                     "budget_gib_k3": budget * state_bytes_k3() / 2 ** 30, "policies": replay(waves, budget)})
    return {"budget_basis": "states_held_peak of sglang_like without eviction", "sglang_like_peak_states": base,
            "eviction": "LRU over states, interior nodes before leaves (tree.lru + tree.drop_state, as the engine's "
                        "state-pool reclaim); pages "
                        "follow the tree (a leaf left without a state is removed)", "runs": runs}


# ---------------------------------------------------------------------- real engine, cache on vs off
def engine_run(model, waves: list[list[Req]], cache: bool, max_tokens: int) -> tuple[float, list, dict]:
    eng = Engine(model, prefix_cache=cache, chunk_size=32, checkpoint_interval=64, page_size=16, decode_batch=8)
    vocab = model.config.vocab_size
    t0 = time.perf_counter()
    outs, comps = [], None
    for t, wave in enumerate(waves):
        if t == 0:
            prompts = [Prompt([x % vocab for x in r.prompt], r.prompt.spans) for r in wave]
        else:
            prompts = [c.extend([x % vocab for x in r.prompt[-(len(r.prompt) - r.parent_len - 1):]])
                       for c, r in zip(comps, wave)]
        comps = eng.generate(prompts, SamplingParams(temperature=1.0, seed=17 + t, max_tokens=max_tokens))
        outs += comps
    return time.perf_counter() - t0, outs, eng.cache_stats()


LONG = dict(system=8000, tasks=4, G=8, turns=12, task_len=(200, 600), gen_len=(300, 1500), tool_len=(20, 200))
SHORT = dict(system=1000, tasks=8, G=4, turns=4, task_len=(50, 300), gen_len=(20, 400), tool_len=(10, 200))


def engine_bench(reps: int) -> dict:
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny")).eval()
    small = make_trace(2, system=160, tasks=2, G=2, turns=3, task_len=(10, 40), gen_len=(8, 8), tool_len=(4, 12))
    times = {True: [], False: []}
    ref = {}
    with torch.inference_mode():
        for _ in range(reps):
            for cache in (False, True):
                dt, outs, st = engine_run(model, small, cache, max_tokens=8)
                times[cache].append(dt)
                ref[cache] = (outs, st)
    on, off = ref[True][0], ref[False][0]
    bitwise = all(a.token_ids == b.token_ids and a.logprobs == b.logprobs for a, b in zip(on, off))
    tokens = sum(len(c.token_ids) for c in on)
    eng = {c: {"wall_s_median": statistics.median(times[c]), "wall_s_all": times[c],
               "generated_tokens_per_s": tokens / statistics.median(times[c]),
               "hit_rate": ref[c][1]["hit_rate"], "computed_tokens": ref[c][1]["computed_tokens"],
               "resume_recomputed_tokens": ref[c][1]["resume_recomputed_tokens"]} for c in (True, False)}
    return {"trace": {"system": 160, "tasks": 2, "G": 2, "turns": 3, "max_tokens": 8},
            "cache_on": eng[True], "cache_off": eng[False],
            "speedup": eng[False]["wall_s_median"] / eng[True]["wall_s_median"],
            "bitwise_equal_on_off": bitwise, "reps": reps}


def print_policies(title: str, pols: dict) -> None:
    print(f"\n{title}")
    print(f"{'policy':18s} {'hit rate':>9s} {'ideal':>7s} {'prompt recompute':>17s} {'resume recompute':>17s} "
          f"{'peak states':>12s} {'evicted':>8s} {'GiB (K3)':>9s}")
    for name, v in pols.items():
        print(f"{name:18s} {v['prompt_token_hit_rate']:9.4f} {v['ideal_hit_rate']:7.4f} "
              f"{v['computed_prompt_tokens']:17d} {v['resume_recomputed_tokens']:17d} "
              f"{v['states_held_peak']:12d} {v.get('states_evicted', 0):8d} {v['state_memory_gib_peak_k3']:9.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--replay-only", action="store_true",
                    help="trace replays only; the engine section is carried over from --out (marked as such)")
    ap.add_argument("--budgets", default="1,0.5,0.25",
                    help="equal-memory state budgets, as fractions of the SGLang-like policy's unlimited peak")
    ap.add_argument("--out", default=str(RESULTS / "prefix_cache.json"))
    args = ap.parse_args()
    fractions = tuple(float(x) for x in args.budgets.split(","))
    traces = {"long_multiturn": make_trace(0, **LONG), "short": make_trace(1, **SHORT)}
    sim = {name: replay(waves) for name, waves in traces.items()}
    equal = {name: equal_memory(waves, sim[name], fractions) for name, waves in traces.items()}

    result = {
        **run_header("prefix_cache", device="cpu"),
        "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "trace_long": {k: LONG[k] for k in ("system", "tasks", "G", "turns")} | {"gen": list(LONG["gen_len"]),
                                                                                "tool": list(LONG["tool_len"])},
        "trace_short": {k: SHORT[k] for k in ("system", "tasks", "G", "turns")} | {"gen": list(SHORT["gen_len"]),
                                                                                  "tool": list(SHORT["tool_len"])},
        "policies": sim,
        "policies_equal_state_memory": equal,
    }
    if args.replay_only:
        old = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
        if "engine_tiny_cpu" in old:
            result["engine_tiny_cpu"] = old["engine_tiny_cpu"]
            result["engine_tiny_cpu_measured_at"] = old.get("engine_tiny_cpu_measured_at") or {
                "commit": old.get("commit"), "note": "carried over from the previous results file (--replay-only)"
                + ("" if old.get("commit") else "; that run did not record its commit")}
    else:
        result["engine_tiny_cpu"] = engine_bench(args.reps)
        result["engine_tiny_cpu_measured_at"] = {"commit": result["commit"], "dirty": result["dirty"]}
    write_results(args.out, result)
    for tname, pols in sim.items():
        print_policies(f"trace {tname} (unlimited state memory, no eviction)", pols)
        for run in equal[tname]["runs"]:
            print_policies(f"trace {tname} at {run['budget_states']} states each ({run['budget_gib_k3']:.0f} GiB at "
                           f"K3; {run['budget_fraction_of_sglang_like_peak']:g} x the SGLang-like peak), LRU eviction",
                           run["policies"])
    if "engine_tiny_cpu" in result:
        e = result["engine_tiny_cpu"]
        print(f"\nengine (tiny, CPU): cache on {e['cache_on']['generated_tokens_per_s']:.2f} tok/s, off "
              f"{e['cache_off']['generated_tokens_per_s']:.2f} tok/s, speedup {e['speedup']:.2f}x, "
              f"bitwise equal: {e['bitwise_equal_on_off']}" + (" (carried over)" if args.replay_only else ""))


if __name__ == "__main__":
    main()
