"""Prefix matching for flat-history clients: exact (key) matching vs token-keyed matching, against the ideal.

OpenAI-style clients of SGLang and vLLM re-send each conversation as one flat token list. The engine's exact
mode matches keys (token + how it was computed), so a flat history matches only where it was computed with the
same segments; token mode (`Engine(prefix_match="tokens")`) matches token ids and reuses decode-produced states.

Workloads (tiny preset, CPU):
1. flat: `--conversations` chats sharing a `--system`-token system prompt, `--turns` turns, greedy; each turn
   re-sends history + new user tokens as one flat list.
2. main job: one update's rollouts of the calculator task (`k3.jobs.episodes.run_episodes`, G samples per task,
   multi-turn with tool calls) on the SFT base (trained and cached first if missing), with the job's own span
   prompts and with every prompt flattened the way a flat client would send it.

Reported per workload and mode: prompt-token hit rate and the ideal one (for each request in arrival order, the
longest prefix of its tokens that the engine had computed before: earlier calls' prompts and all their generated
tokens but the last, and earlier prompts of the same call; a whole-prompt repeat counts fully); and, on the flat
workload, the price of token matching: |log-prob difference| against recomputing every prompt (cache off).
Writes benchmarks/results/prefix_match.json.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks._results import run_header, write_results
from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.rollout import Engine, Prompt, SamplingParams
from k3.rollout.radix import common_prefix

ENGINE = dict(chunk_size=64, checkpoint_interval=256, page_size=16, decode_batch=8)


class Recorder:
    """Wraps an engine's `generate`: optionally flattens prompts (a flat-history client), and counts the ideal
    hit tokens (see the module doc) beside the engine's own."""

    def __init__(self, engine: Engine, flatten: bool):
        self.engine, self.flatten = engine, flatten
        self.computed: list[list[int]] = []   # token sequences the engine fed
        self.prompts: set[tuple[int, ...]] = set()
        self.ideal = self.prompt_tokens = 0

    def generate(self, prompts, sampling):
        sent = [Prompt(list(p)) if self.flatten else p for p in prompts]
        for p in sent:
            toks = list(p)
            best = max((common_prefix(toks, c) for c in self.computed), default=0)
            self.ideal += len(toks) if tuple(toks) in self.prompts else min(best, len(toks) - 1)
            self.prompt_tokens += len(toks)
            self.prompts.add(tuple(toks))
            self.computed.append(toks)
        out = self.engine.generate(sent, sampling)
        for c in out:
            self.computed.append(list(c.prompt) + c.token_ids[:-1])
        return out

    def row(self) -> dict:
        st = self.engine.cache_stats()
        assert st["prompt_tokens"] == self.prompt_tokens
        return {"hit_rate": st["hit_rate"], "ideal_hit_rate": self.ideal / self.prompt_tokens,
                "hit_tokens": st["hit_tokens"], "ideal_hit_tokens": self.ideal, "prompt_tokens": self.prompt_tokens,
                "computed_tokens": st["computed_tokens"], "requests": st["requests"]}


def flat_workload(client, vocab: int, conversations: int, turns: int, system: int, user: int, max_tokens: int,
                  seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()
    sys_prompt = draw(system)
    history = [sys_prompt + draw(user) for _ in range(conversations)]
    outs = []
    for _ in range(turns):
        comps = client.generate(history, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        outs.extend(comps)
        history = [h + c.token_ids + draw(user) for h, c in zip(history, comps)]
    return outs


def run_flat(model, args) -> dict:
    rows, outs = {}, {}
    for name, cache, match in (("recompute", False, "exact"), ("exact", True, "exact"), ("tokens", True, "tokens")):
        rec = Recorder(Engine(model, prefix_cache=cache, prefix_match=match, **ENGINE), flatten=False)
        outs[name] = flat_workload(rec, model.config.vocab_size, args.conversations, args.turns, args.system,
                                   args.user, args.max_tokens)
        rows[name] = rec.row()
    diffs = [abs(a - b) for x, y in zip(outs["recompute"], outs["tokens"]) for a, b in zip(x.logprobs, y.logprobs)]
    rows["tokens"]["logprob_vs_recompute"] = {
        "max_abs": max(diffs), "mean_abs": statistics.fmean(diffs), "n": len(diffs),
        "same_tokens": all(x.token_ids == y.token_ids for x, y in zip(outs["recompute"], outs["tokens"]))}
    rows["exact"]["bitwise_equal_recompute"] = all(
        x.token_ids == y.token_ids and x.logprobs == y.logprobs for x, y in zip(outs["recompute"], outs["exact"]))
    return rows


def run_main_job(args) -> dict:
    from k3.envs import CalculatorEnv, train_tasks
    from k3.jobs.config import load_config
    from k3.jobs.episodes import run_episodes
    from k3.jobs.sft import ensure_base

    cfg = load_config(args.job_config)
    base, _ = ensure_base(cfg, progress=False)
    model = K3ForCausalLM.from_pretrained(base).eval()
    r = cfg.rollout
    env = CalculatorEnv()
    rows = {}
    for name, match, flatten in (("exact_spans", "exact", False), ("tokens_spans", "tokens", False),
                                 ("exact_flat", "exact", True), ("tokens_flat", "tokens", True)):
        eng = Engine(model, prefix_cache=True, prefix_match=match, checkpoint_interval=r.checkpoint_every,
                     device_states=r.state_slots, host_states=r.state_slots, device_pages=r.kv_pages,
                     host_pages=r.kv_pages)
        rec = Recorder(eng, flatten)
        out = run_episodes(rec, env, train_tasks(cfg.rl.train_seed * 1000 + 1, r.tasks_per_update), r.group_size,
                           temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                           max_turn_tokens=r.max_turn_tokens, seed=cfg.rl.train_seed * 7919 + 1)
        rows[name] = rec.row() | {"mean_reward": statistics.fmean(x.reward for x in out)}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system", type=int, default=200)
    ap.add_argument("--user", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--job-config", default="examples/calculator_gspo.toml")
    ap.add_argument("--no-main-job", action="store_true", help="skip the main job's workload (needs the SFT base)")
    ap.add_argument("--out", default="prefix_match")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny")).eval()
    result = {**run_header("prefix_match", device="cpu"),
              "engine": ENGINE,
              "flat_workload": {"conversations": args.conversations, "turns": args.turns, "system": args.system,
                                "user": args.user, "max_tokens": args.max_tokens, "modes": run_flat(model, args)}}
    if not args.no_main_job:
        result["main_job_workload"] = {"config": args.job_config, "modes": run_main_job(args)}
    print(f"{'workload':<10}{'mode':<14}{'hit rate':>10}{'ideal':>8}")
    for wl in ("flat_workload", "main_job_workload"):
        for mode, row in result.get(wl, {}).get("modes", {}).items():
            print(f"{wl.split('_')[0]:<10}{mode:<14}{row['hit_rate']:>10.3f}{row['ideal_hit_rate']:>8.3f}")
    lp = result["flat_workload"]["modes"]["tokens"]["logprob_vs_recompute"]
    print(f"token mode vs recompute: max |dlogp| {lp['max_abs']:.2e}, mean {lp['mean_abs']:.2e}, "
          f"same tokens {lp['same_tokens']}")
    print("wrote", write_results(args.out, result))


if __name__ == "__main__":
    main()
