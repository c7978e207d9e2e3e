"""Speculative decoding (k3.rollout.spec) against plain decoding, in the same process, same engine settings.

CPU (`--cpu`, tiny model: the main job's SFT base and its trained drafter, trained here if not cached; CPU figures,
one intra-op thread as `k3` runs):
  * accept length (tokens per verify step, bonus included) and acceptance rate (accepted / drafted) for the n-gram
    drafter and the trained drafter at draft length 3, greedy, on the held-out calculator prompts (turn 0); whether
    tokens and log-probs are bitwise plain decoding's;
  * decode tokens/s at decode batch 1, 8, 32 (as many prompts as seats): plain, n-gram exact (chain 3, tree
    2x3), drafter exact (chain 3, tree 2x3), drafter batched (chain 3, tree 2x3). Decode time = wall time inside
    the decode forwards (plain) or the speculative steps (spec); tokens = those sampled in decode steps (each
    sequence's first comes from its prefill). Median of `--repeats`.
    Also on the job's own rollouts (k3.jobs.episodes.run_episodes: G = 4 samples per task, all turns, temperature
    1, prefix cache on) with MATCH acceptance, so spec and plain produce the same episodes.
  * ReplaySSM commit time of the reference fold (torch, CPU) at the tiny model's dims.
GPU (`--gpu`): a K3-width model with 4 layers (3 KDA + 1 MLA, 96 heads x 128, hidden 7168, 16 experts top-8, bf16),
  by default trained here on the calculator demonstrations (`--target sft`, `sft_k3_width_model`; `--target random`:
  random weights), its drafter trained here on its own greedy episodes (`gpu_drafter`): decode tokens/s at batch 1,
  8, 32 (held-out prompts, greedy, stop tokens; at least 16 prompts) for plain, the trained drafter (chain 3 and
  tree 2x3 batched, chain 3 exact), n-gram and an oracle drafter (plain decoding's own greedy continuation, one
  draft token in three corrupted: accept length measured, not set); the Triton replay kernel against the torch fold
  at K3's dims. Rows are written as they finish (a call cut off at its limit keeps them, marked `partial`).
  `--episodes N`: also the main job's rollouts of N held-out tasks (temperature 1, MATCH acceptance, prefix cache
  on) at decode batch 8, plain against the n-gram and the trained drafter (`gpu_job_rollouts`).
  Token trees (2x3: top-2 at each of 3 depths, <= 14 nodes): n-gram and drafter rows on CPU (exact: the walk;
  batched: one forward under the tree mask), n-gram batched on the GPU, and the Triton tree verify vs its reference.
Both: the memory table (spec scratch bytes per sequence per KDA layer at K3 dims vs fp32 snapshots), from the
allocation code (k3.rollout.spec.scratch).
Writes benchmarks/results/spec_decode.json (`--out` to redirect; `--merge` keeps the other device's section).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import statistics
import time
import types
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks._results import RESULTS, run_header, write_results
from benchmarks.k3_width import gpu_drafter, k3_width_model, sft_k3_width_model
from benchmarks.spec_kernels import replay_kernel_rows
from k3.rollout import Engine, SamplingParams
from k3.rollout.spec import SpecConfig
from k3.rollout.spec.scratch import scratch_bytes_per_sequence_layer, snapshot_bytes_per_draft


def memory_table() -> list[dict]:
    from k3.config import K3Config
    mc = K3Config.preset("k3")
    snap = snapshot_bytes_per_draft(mc)
    rows = []
    # drafts: draft tokens (nodes) of the shape, positions: what one verify stores (the pending token as well)
    shapes = (("chain 3", 3, 4), ("chain 7", 7, 8), ("16-node tree (pending token + 15 draft nodes)", 15, 16))
    for name, drafts, positions in shapes:
        ours = scratch_bytes_per_sequence_layer(mc, torch.bfloat16, positions)
        rows.append({"shape": name, "verify_positions": positions, "ours_bytes": ours,
                     "snapshot_per_draft_bytes": drafts * snap, "snapshot_per_position_bytes": positions * snap,
                     "ratio_vs_per_draft": ours / (drafts * snap), "ratio_vs_per_position": ours / (positions * snap)})
    return rows


class _DecodeTimer:
    """Wall time inside an engine's decode work: plain decode forwards, or speculative steps."""

    def __init__(self, eng: Engine):
        self.eng = eng
        self.reset()   # seconds, tokens (plain decode's; spec: the engine's counters)
        sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
        if eng.spec is not None:
            step = eng.spec.step

            def timed_step(group):
                sync()
                t = time.perf_counter()
                step(group)
                sync()
                self.seconds += time.perf_counter() - t
            eng.spec.step = timed_step
        else:
            fwd = eng._forward

            def timed_forward(rows, T):
                decode = T == 1 and all(r is None or r.sampling for r in rows)
                sync()
                t = time.perf_counter()
                fwd(rows, T)
                sync()
                if decode:
                    self.seconds += time.perf_counter() - t
                    self.tokens += sum(r is not None for r in rows)
            eng._forward = timed_forward

    def reset(self) -> None:
        """A new run on the same engine: time and tokens from zero, the engine's counters from now."""
        self.seconds, self.tokens = 0.0, 0
        self._start = dict(self.eng.stats)

    def counted(self, name: str) -> int:
        """The engine's counter `name` since the last reset."""
        return self.eng.stats.get(name, 0) - self._start.get(name, 0)


class Oracle:
    """Drafts plain decoding's own continuation, corrupting one draft token in three (see the module docstring)."""

    def __init__(self, refs: list[list[int]], vocab: int):
        self.refs, self.vocab, self.calls = refs, vocab, 0

    def propose(self, context, k):
        self.calls += 1
        for ref in self.refs:
            if len(ref) > len(context) and ref[:len(context)] == context:
                cont = list(ref[len(context):len(context) + k])
                if self.calls % 3 == 0 and cont:
                    cont[self.calls % len(cont)] = (cont[self.calls % len(cont)] + 1) % self.vocab
                return cont
        return []


def overlap_drafting(eng: Engine) -> None:
    """Each row's next chain drafted at the end of its step, the head on a side stream beside the commit
    (`SpecDecoder.overlap_drafting`)."""
    eng.spec.overlap_drafting = True


def eager_trees(eng: Engine) -> None:
    """Token-tree verifies and the drafter's tree levels run eagerly (`DecodeGraphs.trees` off): what the graphs
    buy a tree."""
    if eng.graphs is not None:
        eng.graphs.trees = False
        if hasattr(eng.spec.drafter, "capture_graphs"):
            eng.spec.drafter.capture_graphs(trees=False)


def bench_engine(model, spec, batch: int, step_tokens: int | None = None, prefix_cache: bool = False,
                 **settings) -> Engine:
    """The engine every throughput row, phase and profile runs on: decode batch `batch`, room for every prompt
    (max_running, states, pages), `step_tokens` its max_step_tokens (None: the engine's default); `settings`: any
    other EngineConfig field (e.g. cuda_graphs)."""
    steps = {} if step_tokens is None else {"max_step_tokens": step_tokens}
    return Engine(model, prefix_cache=prefix_cache, speculative=spec, decode_batch=batch, max_running=max(32, batch),
                  device_states=max(256, 2 * batch + 2), device_pages=8192, **steps, **settings)


def _run(model, prompts, sp, spec, batch, oracle_refs=None, repeats=1, drive=None, warmup=0, setup=None,
         step_tokens: int | None = None) -> dict:
    """`drive(engine) -> completions` (default: one generate of `prompts` with `sp`); `setup(engine)` after an
    engine is made; `step_tokens`: the engine's max_step_tokens (None: its default). The first `warmup` runs are
    not timed (on the GPU a batch size's first run compiles its kernels and captures its CUDA graphs). Without
    `drive` (no prefix cache) every run goes through one engine, as a serving engine lives on: its captured
    graphs are replayed by the timed runs; `drive` runs (prefix cache on) get a fresh engine each."""
    times, out, stats, eng = [], None, None, None
    for i in range(warmup + repeats):
        if eng is None or drive is not None:
            eng = bench_engine(model, spec, batch, step_tokens, prefix_cache=drive is not None)
            timer = _DecodeTimer(eng)
            if setup is not None:
                setup(eng)
        if oracle_refs is not None:
            eng.spec.drafter = Oracle(oracle_refs, model.config.vocab_size)   # its corruption count from 0
        timer.reset()
        out = drive(eng) if drive is not None else eng.generate(prompts, sp)
        if i >= warmup:
            times.append(timer.seconds)
        stats = {k: timer.counted(k) if not k.endswith("_max") else v for k, v in eng.stats.items()}
    tokens = stats["spec_emitted_tokens"] if spec is not None else timer.tokens
    med = statistics.median(times)
    row = {"decode_tokens": tokens, "decode_seconds_median": med, "decode_seconds": times,
           "decode_tokens_per_s": tokens / med if med else None, "forwards": stats["forwards"]}
    if eng.graphs is not None:
        row["cuda_graphs"] = len(eng.graphs.shapes)
    if spec is not None:
        row.update(accept_length=stats["spec_emitted_tokens"] / max(stats["spec_verifies"], 1),
                   acceptance_rate=stats["spec_accepted_tokens"] / max(stats["spec_draft_tokens"], 1),
                   verifies=stats["spec_verifies"], scratch_bytes_max=stats["spec_scratch_bytes_max"])
    return row, out


def episodes_driver(env, tasks, max_turn_tokens: int):
    """`drive(engine) -> completions` of the main job's rollouts: `run_episodes` of `tasks`, groups of 4 at
    temperature 1 (seed 5), each episode as a completion (token_ids, logprobs, the model tokens' routed experts) to
    compare with plain decoding's."""
    from k3.jobs.episodes import run_episodes

    def drive(eng):
        rs = run_episodes(eng, env, tasks, 4, temperature=1.0, top_p=1.0, top_k=0, max_turn_tokens=max_turn_tokens,
                          seed=5)
        return [types.SimpleNamespace(token_ids=list(r.episode.tokens), logprobs=list(r.logprobs),
                                      routed_experts=torch.stack([x for x in r.routed if x is not None])
                                      if any(x is not None for x in r.routed) else torch.zeros(0))
                for r in rs]
    return drive


def _same(a, b) -> bool:
    """Bitwise the same completions: tokens, log-probs and the routed experts (Router Replay's record)."""
    return len(a) == len(b) and all(
        x.token_ids == y.token_ids and x.logprobs == y.logprobs and torch.equal(x.routed_experts, y.routed_experts)
        for x, y in zip(a, b))


PHASES = ("propose", "verify_batched", "next_logits", "commit")   # the speculative step's phases, in order


@contextlib.contextmanager
def patched_phases(wrap, step: bool = False):
    """While the block runs, each phase of the batched speculative step (`PHASES`: `SpecDecoder._propose_group`,
    and decode.py's `verify_batched`, `next_logits`, `commit`) -- and with `step` the whole `SpecDecoder.step` --
    replaced by `wrap(name, fn)`; restored afterwards."""
    import k3.rollout.spec.decode as decode_module
    # phase -> (the object holding it, its attribute)
    where = {n: (decode_module, n) for n in ("verify_batched", "next_logits", "commit")}
    where["propose"] = (decode_module.SpecDecoder, "_propose_group")
    if step:
        where["step"] = (decode_module.SpecDecoder, "step")
    saved = {n: getattr(owner, attr) for n, (owner, attr) in where.items()}
    for n, (owner, attr) in where.items():
        setattr(owner, attr, wrap(n, saved[n]))
    try:
        yield
    finally:
        for n, (owner, attr) in where.items():
            setattr(owner, attr, saved[n])


@contextlib.contextmanager
def phase_timers(sync):
    """Wall time of the batched speculative step's phases while the block runs, the device synchronised (`sync`)
    around each, so a phase's figure includes its device work: drafting (`_propose_group`), the verify forward
    (`verify_batched`), the acceptance walk's picks (`next_logits`), the commit. Yields a Counter: phase ->
    seconds, and "steps" -> the steps drafted."""
    spent = collections.Counter()

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            sync()
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            spent[name] += time.perf_counter() - t
            if name == "propose":
                spent["steps"] += 1
            return out
        return wrapper
    with patched_phases(timed):
        yield spent


def step_phases(model, prompts, sp, spec, batch: int, step_tokens: int | None, runs: int = 2, setup=None) -> dict:
    """ms per speculative step of each phase (`phase_timers`), the step's wall time (`_DecodeTimer`) and the rest
    (the host's bookkeeping between phases): the fastest of `runs` runs after a warm-up run (a one-off, such as
    the allocator growing its pool, does not stand in for a step). `setup(engine)` as in `_run`. The syncs
    around each phase also undo any overlap between phases (`overlap_drafting`): its gain shows in the
    throughput rows only."""
    eng = bench_engine(model, spec, batch, step_tokens)
    if setup is not None:
        setup(eng)
    timer = _DecodeTimer(eng)
    eng.generate(prompts, sp)   # kernel builds, graph captures
    sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
    best = None
    for _ in range(runs):
        with phase_timers(sync) as spent:
            timer.reset()
            eng.generate(prompts, sp)
        n = max(spent.pop("steps", 0), 1)
        parts = {k: round(v / n * 1e3, 3) for k, v in spent.items()}
        step = timer.seconds / n * 1e3
        if best is None or step < best["step_ms"]:
            best = {"steps": n, "step_ms": round(step, 3), **parts, "rest_ms": round(step - sum(parts.values()), 3)}
    return best


def cpu_section(repeats: int) -> dict:
    from k3.envs import CalculatorEnv
    from k3.envs.calc_task import heldout_tasks
    from k3.jobs.config import load_config
    from k3.jobs.sft import ensure_base
    from k3.model import K3ForCausalLM
    from k3.rollout.spec.train_drafter import ensure_drafter
    from k3_kernels.replay_ssm import naive_replay_commit
    torch.set_num_threads(1)
    job = load_config(None, {})
    base, _ = ensure_base(job)
    drafter_dir, _ = ensure_drafter(job)
    model = K3ForCausalLM.from_pretrained(base).eval()
    env = CalculatorEnv()
    tasks = heldout_tasks()
    sp = SamplingParams(temperature=0.0, max_tokens=job.rollout.max_turn_tokens, stop_token_ids=tuple(env.stop_ids))
    methods = {"ngram_exact": SpecConfig(draft_len=3),
               "ngram_tree_2x3_exact": SpecConfig(draft_len=3, branching=2),
               "drafter_exact": SpecConfig(method="drafter", draft_len=3, drafter_path=str(drafter_dir)),
               "drafter_tree_2x3_exact": SpecConfig(method="drafter", draft_len=3, branching=2,
                                                    drafter_path=str(drafter_dir)),
               "drafter_batched": SpecConfig(method="drafter", draft_len=3, verify="batched",
                                             drafter_path=str(drafter_dir)),
               "drafter_tree_2x3_batched": SpecConfig(method="drafter", draft_len=3, branching=2, verify="batched",
                                                      drafter_path=str(drafter_dir))}
    job_rows = []
    for batch in (8, 32):
        drive = episodes_driver(env, tasks[:max(2, batch // 4)], job.rollout.max_turn_tokens)
        plain, ref = _run(model, None, None, None, batch, repeats=repeats, drive=drive)
        row = {"batch": batch, "tasks": max(2, batch // 4), "group": 4, "plain": plain}
        for name, spec in (("ngram_exact_match", SpecConfig(draft_len=3, acceptance="match")),
                           ("drafter_exact_match", SpecConfig(method="drafter", draft_len=3, acceptance="match",
                                                              drafter_path=str(drafter_dir))),
                           ("drafter_tree_2x3_exact_match", SpecConfig(method="drafter", draft_len=3, branching=2,
                                                                       acceptance="match",
                                                                       drafter_path=str(drafter_dir))),
                           ("drafter_batched_match", SpecConfig(method="drafter", draft_len=3, acceptance="match",
                                                                verify="batched", drafter_path=str(drafter_dir)))):
            r, out = _run(model, None, None, spec, batch, repeats=repeats, drive=drive)
            r["bitwise_equal_to_plain"] = _same(out, ref)
            r["speedup_vs_plain"] = (r["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
                                     if plain["decode_tokens_per_s"] else None)
            row[name] = r
        job_rows.append(row)
        print(json.dumps({k: (v if not isinstance(v, dict) else {kk: vv for kk, vv in v.items()
                                                                 if kk != "decode_seconds"}) for k, v in row.items()}))
    rows = []
    for batch in (1, 8, 32):
        prompts = [env.prompt(t) for t in tasks[:max(batch, 8)]]
        plain, ref = _run(model, prompts, sp, None, batch, repeats=repeats)
        row = {"batch": batch, "prompts": len(prompts), "plain": plain}
        for name, spec in methods.items():
            r, out = _run(model, prompts, sp, spec, batch, repeats=repeats)
            r["bitwise_equal_to_plain"] = _same(out, ref)
            r["speedup_vs_plain"] = (r["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
                                     if plain["decode_tokens_per_s"] else None)
            row[name] = r
        rows.append(row)
        print(json.dumps({k: (v if not isinstance(v, dict) else {kk: vv for kk, vv in v.items()
                                                                 if kk != "decode_seconds"}) for k, v in row.items()}))
    mc = model.config
    B, T, H, K = 8, 4, mc.kda_num_heads, mc.kda_head_dim
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(B, H, K, K, generator=g), torch.randn(T, B, H, K, generator=g),
            torch.randn(T, B, H, K, generator=g), -torch.rand(T, B, H, K, generator=g),
            torch.rand(T, B, H, generator=g),
            torch.full((B,), 3))
    ts = []
    for _ in range(30):
        t = time.perf_counter()
        naive_replay_commit(*args)
        ts.append(time.perf_counter() - t)
    accept = [{"method": name, "shape": spec.shape, "verify": spec.verify.value,
               "accept_length": rows[1][name]["accept_length"], "acceptance_rate": rows[1][name]["acceptance_rate"],
               "bitwise_equal_to_plain": rows[1][name]["bitwise_equal_to_plain"]}
              for name, spec in methods.items()]   # batch 8 (the rows at batch 1 and 32 hold the same walk)
    return {"device": "cpu", "model": "tiny (the main job's SFT base)", "drafter": str(drafter_dir),
            "accept_length_calculator": accept,
            "workload": f"{len(tasks)} held-out calculator prompts (first max(batch, 8)), greedy, turn 0, "
                        f"max_tokens {sp.max_tokens}, stop at the task's stop tokens",
            "throughput": rows, "job_rollouts": job_rows,
            "replay_commit_cpu": {"shape": f"B={B} T={T} H={H} K=V={K}, 3 accepted", "torch_fold_us_median":
                                  statistics.median(ts) * 1e6}}


def gpu_job_rollouts(model, env, drafter_dir: Path, cfg: "GpuSettings", batch: int = 8) -> dict:
    """The main job's own rollouts on the GPU target (`episodes_driver`: every turn of `cfg.episodes_tasks`
    held-out tasks, groups of 4 at temperature 1, the prefix cache on) at decode batch `batch`: plain decoding
    against the n-gram and the trained drafter (batched chain 3) with MATCH acceptance, so both produce the same
    episodes (bitwise checked). What an RL rollout pool sees, unlike the greedy rows."""
    from k3.envs.calc_task import heldout_tasks
    from k3.jobs.config import load_config
    tasks = heldout_tasks()[:cfg.episodes_tasks]
    drive = episodes_driver(env, tasks, load_config(None, {}).rollout.max_turn_tokens)
    plain, ref = _run(model, None, None, None, batch, repeats=cfg.repeats, drive=drive)
    row = {"batch": batch, "tasks": len(tasks), "group": 4, "temperature": 1.0, "plain": plain}
    for name, spec in (("ngram_batched_match", SpecConfig(draft_len=3, acceptance="match", verify="batched")),
                       ("drafter_batched_match", SpecConfig(method="drafter", draft_len=3, acceptance="match",
                                                            verify="batched", drafter_path=str(drafter_dir)))):
        r, out = _run(model, None, None, spec, batch, repeats=cfg.repeats, drive=drive)
        r["bitwise_equal_to_plain"] = _same(out, ref)
        r["speedup_vs_plain"] = (r["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
                                 if plain["decode_tokens_per_s"] else None)
        row[name] = r
    print("job_rollouts", json.dumps({k: (v if not isinstance(v, dict) else {kk: vv for kk, vv in v.items()
                                                                             if kk != "decode_seconds"})
                                      for k, v in row.items()}), flush=True)
    return row


@dataclass(frozen=True)
class GpuSettings:
    """The GPU section's run settings (the command line's GPU flags)."""
    repeats: int = 3
    budget_s: float = 200.0             # no batch row starts after this many seconds
    target: str = "sft"                 # "random" (random weights; greedy, 32 new tokens, no stop) or "sft"
    sft_steps: int = 300
    sft_lr: float = 1e-4
    sft_budget_s: float = 150.0
    sft_freeze_routed_experts: bool = False   # the SFT target with its routed experts left at random init (an H100)
    sft_micro_batch: int | None = None  # SFT rows forwarded at once (None: the whole step's batch)
    sft_bf16_frozen_tables: bool = False  # the frozen embedding and lm_head in bf16 while training
    drafter_steps: int = 400
    drafter_tasks: int = 1024           # training tasks rolled out for the drafter (sft target)
    batches: tuple[int, ...] = (1, 8, 32)
    step_tokens: int | None = None      # the engines' max_step_tokens (None: the engine's default)
    only: tuple[str, ...] | None = None  # these methods (names); None: all
    profile: bool = False               # phases of a step per batch (`step_phases`) and cProfile at batch 8
    episodes_tasks: int = 0             # > 0: the main job's rollouts of this many held-out tasks (`job_rollouts`)


def gpu_section(cfg: GpuSettings, sink=None) -> dict:
    """`cfg.target`: "random" (random weights; greedy, 32 new tokens, no stop) or "sft" (trained on the calculator
    demonstrations here, `sft_k3_width_model`; greedy, stopping at the task's stop tokens, at most 32 new tokens,
    as the CPU section's workload). `sink(partial)` gets the section after each batch row. `cfg.step_tokens`: the
    engines' max_step_tokens, for plain and speculative alike (large: every prompt prefilled before the decode
    steps, so a decode step holds min(batch, live rows) rows; the default 256 interleaves one prompt's chunks a
    step with decoding, and short answers leave batch-8 steps half empty)."""
    import tempfile
    from k3.envs import CalculatorEnv
    from k3.envs.calc_task import heldout_tasks
    t_start = time.perf_counter()
    env = CalculatorEnv()
    sft_fig = None
    if cfg.target == "sft":
        model, sft_fig = sft_k3_width_model(cfg.sft_steps, cfg.sft_lr, cfg.sft_budget_s,
                                            freeze_routed_experts=cfg.sft_freeze_routed_experts,
                                            micro_batch=cfg.sft_micro_batch,
                                            bf16_frozen_tables=cfg.sft_bf16_frozen_tables)
        print("sft", json.dumps(sft_fig), flush=True)
        sp = SamplingParams(temperature=0.0, max_tokens=32, stop_token_ids=tuple(env.stop_ids))
    else:
        model = k3_width_model()
        sp = SamplingParams(temperature=0.0, max_tokens=32)
    drafter_dir, drafter_fig = gpu_drafter(model, Path(tempfile.mkdtemp()) / "drafter",
                                           cfg.drafter_tasks if cfg.target == "sft" else 64, cfg.drafter_steps,
                                           sp, episodes=cfg.target == "sft")
    print("drafter", json.dumps(drafter_fig), flush=True)
    prompts_all = [env.prompt(t) for t in heldout_tasks()][:32]
    warm = SamplingParams(temperature=0.0, max_tokens=6)   # kernel builds (decode, verify widths) before timing
    tree = SpecConfig(method="drafter", draft_len=3, branching=2, verify="batched", drafter_path=str(drafter_dir))
    methods = (("oracle_batched", SpecConfig(draft_len=3, verify="batched"), True, None),
               ("ngram_batched", SpecConfig(draft_len=3, verify="batched"), False, None),
               ("drafter_batched", SpecConfig(method="drafter", draft_len=3, verify="batched",
                                              drafter_path=str(drafter_dir), drafter_dtype="target"), False, None),
               ("drafter_head_only_batched", SpecConfig(method="drafter", draft_len=3, verify="batched",
                                                        drafter_path=str(drafter_dir), lookup=0), False, None),
               ("drafter_overlap_batched", SpecConfig(method="drafter", draft_len=3, verify="batched",
                                                      drafter_path=str(drafter_dir), drafter_dtype="target"), False,
                overlap_drafting),
               ("drafter_fp32_batched", SpecConfig(method="drafter", draft_len=3, verify="batched",
                                                   drafter_path=str(drafter_dir), drafter_dtype="float32"), False,
                None),
               ("drafter_fp8_batched", SpecConfig(method="drafter", draft_len=3, verify="batched",
                                                  drafter_path=str(drafter_dir), drafter_dtype="float8"), False,
                None),
               ("drafter_fp8_overlap_batched", SpecConfig(method="drafter", draft_len=3, verify="batched",
                                                          drafter_path=str(drafter_dir), drafter_dtype="float8"),
                False, overlap_drafting),
               ("drafter_tree_2x3_batched", tree, False, None),
               ("drafter_exact", SpecConfig(method="drafter", draft_len=3, drafter_path=str(drafter_dir)), False,
                None),
               ("drafter_tree_2x3_eager", tree, False, eager_trees))
    if cfg.only:
        unknown = set(cfg.only) - {m[0] for m in methods}
        if unknown:
            raise ValueError(f"--only: unknown methods {sorted(unknown)}; have {[m[0] for m in methods]}")
        methods = tuple(m for m in methods if m[0] in cfg.only)
    for spec in [None] + [m[1] for m in methods]:
        Engine(model, prefix_cache=False, speculative=spec, decode_batch=1).generate([prompts_all[0]], warm)
    rows = []
    section = {"device": torch.cuda.get_device_name(), "target": cfg.target, "sft": sft_fig, "throughput": rows,
               "max_step_tokens": cfg.step_tokens}
    for batch in cfg.batches:
        if time.perf_counter() - t_start > cfg.budget_s:
            rows.append({"batch": batch, "skipped": f"time budget {cfg.budget_s} s reached"})
            continue
        prompts = prompts_all[:max(batch, 16)]   # batch 1 and 8: sixteen prompts (8 gave 51 decode tokens)
        plain, ref = _run(model, prompts, sp, None, batch, repeats=cfg.repeats, warmup=1, step_tokens=cfg.step_tokens)
        refs = [p + c.token_ids for p, c in zip(prompts, ref)]
        row = {"batch": batch, "plain": plain}
        for name, spec, oracle, setup in methods:
            try:
                r, out = _run(model, prompts, sp, spec, batch, oracle_refs=refs if oracle else None,
                              repeats=cfg.repeats, warmup=1, setup=setup, step_tokens=cfg.step_tokens)
            except Exception as e:   # recorded, so one broken method does not lose the other rows of a device call
                row[name] = {"error": f"{type(e).__name__}: {e}"}
                print("error", name, row[name]["error"], flush=True)
                continue
            r["bitwise_equal_to_plain"] = _same(out, ref)
            r["speedup_vs_plain"] = (r["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
                                     if plain["decode_tokens_per_s"] else None)
            row[name] = r
        if batch == cfg.batches[0]:
            section["sample_continuations"] = [" ".join(env.tok.decode([t]) if t < len(env.tok) else f"<{t}>"
                                                        for t in c.token_ids) for c in ref[:4]]
        rows.append(row)
        print(json.dumps({k: (v if not isinstance(v, dict) else {kk: vv for kk, vv in v.items()
                                                                 if kk != "decode_seconds"}) for k, v in row.items()}),
              flush=True)
        if sink is not None:
            sink(section)
        if cfg.profile:
            by_name = {m[0]: m for m in methods}
            for name in ("ngram_batched", "drafter_batched", "drafter_overlap_batched", "drafter_fp32_batched",
                         "drafter_fp8_batched"):
                if name in by_name:
                    _, spec, _, setup = by_name[name]
                    phases = step_phases(model, prompts, sp, spec, batch, cfg.step_tokens, setup=setup)
                    print(f"phases batch {batch} {name}: {json.dumps(phases)}", flush=True)
                    section.setdefault("step_phases_ms", []).append({"batch": batch, "method": name, **phases})
        if cfg.profile and batch == 8:   # where a plain and a speculative step's host time goes (stdout only)
            import cProfile
            import pstats
            drafter = {m[0]: m[1] for m in methods}.get("drafter_batched")
            for spec in (None,) + ((drafter,) if drafter is not None else ()):
                prof = cProfile.Profile()
                prof.enable()
                _run(model, prompts, sp, spec, batch, step_tokens=cfg.step_tokens)
                prof.disable()
                print("profile", "plain" if spec is None else "drafter_batched", flush=True)
                pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    if cfg.episodes_tasks and time.perf_counter() - t_start <= cfg.budget_s:
        section["job_rollouts"] = gpu_job_rollouts(model, env, drafter_dir, cfg)
        if sink is not None:
            sink(section)
    weights = ("random weights" if cfg.target == "random" else
               "trained here on the calculator demonstrations (sft: embedding and lm_head frozen at random init)")
    stop = "no stop" if cfg.target == "random" else "stopping at the task's stop tokens"
    return {**section, "model": f"K3 width, 4 layers (3 KDA + 1 MLA), 16 experts top-8, {weights}, bf16",
            "workload": f"held-out calculator prompts (264 tokens; as many as the batch), greedy, at most 32 new "
                        f"tokens, {stop}",
            "drafter": {"trained_on": "the model's own greedy rollouts of calculator training tasks (sft: whole "
                                      "episodes; random: turn 0 as the workload)", **drafter_fig},
            **replay_kernel_rows()}


def main() -> None:
    gpu = GpuSettings()   # the GPU flags' defaults
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="CPU and GPU rows (the GPU's: 5 advised)")
    ap.add_argument("--gpu-budget", type=float, default=gpu.budget_s)
    ap.add_argument("--drafter-steps", type=int, default=gpu.drafter_steps, help="GPU drafter training steps")
    ap.add_argument("--drafter-tasks", type=int, default=gpu.drafter_tasks,
                    help="GPU drafter: training tasks rolled out (sft)")
    ap.add_argument("--profile", action="store_true",
                    help="GPU: a step's phases per batch (n-gram, the drafter in bf16 and fp32); cProfile at batch 8")
    ap.add_argument("--target", choices=("random", "sft"), default=gpu.target, help="GPU target model")
    ap.add_argument("--sft-steps", type=int, default=gpu.sft_steps)
    ap.add_argument("--sft-lr", type=float, default=gpu.sft_lr)
    ap.add_argument("--sft-budget", type=float, default=gpu.sft_budget_s, help="GPU SFT seconds at most")
    ap.add_argument("--sft-freeze-routed-experts", action="store_true",
                    help="GPU SFT target: routed experts left at random init (meant for an 80 GB H100; another target)")
    ap.add_argument("--sft-micro-batch", type=int, default=gpu.sft_micro_batch,
                    help="GPU SFT: each step's rows forwarded this many at a time (with --sft-bf16-frozen-tables: "
                         "training every parameter within an 80 GB H100, 8)")
    ap.add_argument("--sft-bf16-frozen-tables", action="store_true",
                    help="GPU SFT: the frozen embedding and lm_head held in bf16 while training")
    ap.add_argument("--batches", default=",".join(map(str, gpu.batches)))
    ap.add_argument("--out", default=str(RESULTS / "spec_decode.json"))
    ap.add_argument("--step-tokens", type=int, default=None,
                    help="GPU: the engines' max_step_tokens (e.g. 4096: every prompt prefilled before decoding)")
    ap.add_argument("--only", default=None, help="GPU: comma-separated method names (default: all)")
    ap.add_argument("--episodes", type=int, default=0,
                    help="GPU: also the main job's rollouts (temperature 1, MATCH) of this many held-out tasks")
    ap.add_argument("--merge", default=None, help="keep this results file's sections that this run does not measure")
    a = ap.parse_args()
    device = "cuda" if a.gpu else "cpu"
    res = run_header("spec_decode", device)
    if a.merge and Path(a.merge).exists():
        old = json.loads(Path(a.merge).read_text())
        for k in ("cpu", "gpu"):
            if k in old:   # each kept section names the run it came from
                res[k] = old[k]
                res.setdefault("sections_from", {})[k] = old.get("sections_from", {}).get(k, old.get("commit"))
    res["memory_table_k3_dims_per_sequence_per_kda_layer"] = memory_table()
    if a.cpu:
        res["cpu"] = cpu_section(a.repeats)
        res.get("sections_from", {}).pop("cpu", None)
    if a.gpu:
        def sink(partial):   # a run cut off at the device's limit still leaves its finished rows
            write_results(a.out, {**res, "gpu": {**partial, "partial": True}})
        settings = GpuSettings(repeats=a.repeats, budget_s=a.gpu_budget, target=a.target, sft_steps=a.sft_steps,
                               sft_lr=a.sft_lr, sft_budget_s=a.sft_budget, drafter_steps=a.drafter_steps,
                               drafter_tasks=a.drafter_tasks, batches=tuple(int(b) for b in a.batches.split(",")),
                               step_tokens=a.step_tokens, only=tuple(a.only.split(",")) if a.only else None,
                               profile=a.profile, episodes_tasks=a.episodes,
                               sft_freeze_routed_experts=a.sft_freeze_routed_experts,
                               sft_micro_batch=a.sft_micro_batch, sft_bf16_frozen_tables=a.sft_bf16_frozen_tables)
        res["gpu"] = gpu_section(settings, sink)
        res.get("sections_from", {}).pop("gpu", None)
    print(json.dumps(res["memory_table_k3_dims_per_sequence_per_kda_layer"], indent=1))
    print("wrote", write_results(a.out, res))


if __name__ == "__main__":
    main()
