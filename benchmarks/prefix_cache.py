"""Prefix caching for RL rollouts on the hybrid MLA+KDA model: ours vs SGLang-like vs vLLM-like policies.

1. A generator of RL rollout traces: one long shared system prompt, tasks with G samples each, T turns alternating
   model generation and tool outputs of random lengths (contexts grow long). Requests arrive turn by turn, the G
   samples of a task together.
2. The same trace replayed through three checkpoint policies implemented on the same radix tree (k3.rollout.radix):
   - ours: keys carry the segment structure (bitwise-exact reuse); KDA checkpoints at every prompt end (with its
     logits: n samples and repeated prompts hit fully), at every turn end (resumes recompute nothing), at the
     branch point as soon as a request diverges from a cached path, and every 256 tokens;
   - SGLang-like (UnifiedRadixCache extra_buffer): one checkpoint per extend at its last 64-aligned point, decode
     checkpoints every 256 tokens, on finish only the last tracked state is kept (the KV key is truncated to it),
     branch points planted only when a second sibling arrives; a hit must leave >= 1 token to compute;
   - vLLM-like align mode: states only at block boundaries (block = 528 tokens), hit = last cached boundary.
   Reported: prompt-token hit rate, tokens recomputed at turn resumes, KDA states held and their memory at the
   full K3 config (no eviction: unlimited memory for every policy).
3. The real engine (tiny preset, CPU) on a small trace of the same shape, prefix cache on vs off: wall time,
   tokens/s (median of runs) and a bitwise comparison of the outputs.
Writes benchmarks/results/prefix_cache.json.
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
    """Replays requests on a RadixTree holding integer state ids; counts states held."""
    name = ""

    def __init__(self):
        self.tree = RadixTree(1, release_state=self._release)
        self.live_states = 0
        self.peak_states = 0
        self.next_state = 0
        self.stats = {"prompt_tokens": 0, "hit_tokens": 0, "resume_tokens": 0, "resume_recomputed": 0,
                      "computed_prompt_tokens": 0, "requests": 0, "fresh_tokens": 0}

    def _release(self, s: int) -> None:
        self.live_states -= 1

    def _state(self) -> int:
        self.live_states += 1
        self.peak_states = max(self.peak_states, self.live_states)
        self.next_state += 1
        return self.next_state

    def insert(self, key: list[int], upto: int, extra=None) -> None:
        if upto > 0:
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
            if key_kind(key[pos - 1]) == KIND_PREFILL_END or pos % CKPT == 0 or pos == branch:
                self.insert(key, pos, extra=True if key_kind(key[pos - 1]) == KIND_PREFILL_END else None)
        self.insert(key, len(key))   # turn end


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


def replay(waves: list[list[Req]]) -> dict:
    out = {}
    sb = state_bytes_k3()
    for cls in (Ours, SGLangLike, VLLMAlign):
        pol = cls()
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
    return out


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "prefix_cache.json"))
    args = ap.parse_args()
    long_trace = make_trace(0, system=8000, tasks=4, G=8, turns=12, task_len=(200, 600), gen_len=(300, 1500),
                            tool_len=(20, 200))
    short_trace = make_trace(1, system=1000, tasks=8, G=4, turns=4, task_len=(50, 300), gen_len=(20, 400),
                             tool_len=(10, 200))
    sim = {"long_multiturn": replay(long_trace), "short": replay(short_trace)}

    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny")).eval()
    small = make_trace(2, system=160, tasks=2, G=2, turns=3, task_len=(10, 40), gen_len=(8, 8), tool_len=(4, 12))
    times = {True: [], False: []}
    ref = {}
    with torch.inference_mode():
        for _ in range(args.reps):
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
    result = {
        "device": "cpu", "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "trace_long": {"system": 8000, "tasks": 4, "G": 8, "turns": 12, "gen": [300, 1500], "tool": [20, 200]},
        "trace_short": {"system": 1000, "tasks": 8, "G": 4, "turns": 4, "gen": [20, 400], "tool": [10, 200]},
        "policies": sim,
        "engine_tiny_cpu": {"trace": {"system": 160, "tasks": 2, "G": 2, "turns": 3, "max_tokens": 8},
                            "cache_on": eng[True], "cache_off": eng[False],
                            "speedup": eng[False]["wall_s_median"] / eng[True]["wall_s_median"],
                            "bitwise_equal_on_off": bitwise, "reps": args.reps},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    for tname, pols in sim.items():
        print(f"\ntrace {tname}")
        print(f"{'policy':18s} {'hit rate':>9s} {'ideal':>7s} {'resume recompute':>17s} {'peak states':>12s} "
              f"{'GiB (K3)':>9s}")
        for name, v in pols.items():
            print(f"{name:18s} {v['prompt_token_hit_rate']:9.4f} {v['ideal_hit_rate']:7.4f} "
                  f"{v['resume_recomputed_tokens']:17d} "
                  f"{v['states_held_peak']:12d} {v['state_memory_gib_peak_k3']:9.1f}")
    print(f"\nengine (tiny, CPU): cache on {eng[True]['generated_tokens_per_s']:.2f} tok/s, off "
          f"{eng[False]['generated_tokens_per_s']:.2f} tok/s, speedup {result['engine_tiny_cpu']['speedup']:.2f}x, "
          f"bitwise equal: {bitwise}")


if __name__ == "__main__":
    main()
