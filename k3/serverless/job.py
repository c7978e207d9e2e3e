"""`k3 rl --serverless URL`: the main job's GSPO loop on the calculator task, through a `k3 serve` service.

Per update: snapshot the session's weights for sampling (`save_weights_and_get_sampling_client`), sample G
episodes of every task (multi-turn, the tool's output appended between turns; the sample calls of a turn are
issued together and batched by the server), rubric rewards, group advantages (`k3.rl.group_advantages`), then
`forward_backward(data, "gspo")` in chunks of the server's `max_data` and one `optim_step`. The sampler's
log-probs are pi_old; the per-token advantage A_i / (n_i B) makes the service's token-sum GSPO equal the
embedded learner's seq-mean-token-mean aggregation. With `rl.router_replay` the sampler also returns each token's
routing and the data carry it (`loss_fn_inputs["routed_experts"]`): forward_backward routes every generated
position through the experts the sampler chose (prompt and tool positions route freely)."""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from k3.envs import CalculatorEnv, heldout_tasks, train_tasks
from k3.envs.calc_task import Episode, Task
from k3.jobs.config import JobConfig
from k3.serverless.client import SamplingClient, ServiceClient, TrainingClient
from k3.serverless.types import AdamParams, Datum, ModelInput, SamplingParams


@dataclass
class Rollout:
    episode: Episode
    logprobs: list[float]     # aligned with episode.tokens (0.0 at prompt and tool tokens)
    reward: float = 0.0
    routed: dict[int, list] = field(default_factory=dict)   # input position -> its recorded routing (R3)

    def add_turn(self, seq, tool: list[int], start: int) -> None:
        """Record a sampled turn that began at transcript position `start`: token i was produced by position
        start - 1 + i, so that position's routing is the sampler's routing of token i."""
        self.logprobs += list(seq.logprobs) + [0.0] * len(tool)
        for i, r in enumerate(seq.routed_experts or ()):
            self.routed[start - 1 + i] = r


def _seed(base: int, index: int, turn: int) -> int:
    return (base * 1_000_003 + index * 101 + turn) % (2 ** 63)


def sample_episodes(sampler: SamplingClient, env: CalculatorEnv, tasks: list[Task], group_size: int, *,
                    temperature: float, top_p: float, top_k: int, max_turn_tokens: int, seed: int,
                    routing: bool = False) -> list[Rollout]:
    """G episodes of every task through the sampler; deterministic given `seed`. `routing`: record the sampler's
    expert routing of every generated token (Router Replay)."""
    def params(s: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_turn_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                              seed=s, stop=tuple(env.stop_ids))

    rollouts: list[Rollout] = []
    futs = []
    for gi, task in enumerate(tasks):
        ep0 = env.start(task)
        futs.append(sampler.sample_async(ModelInput.from_ints(ep0.tokens), group_size, params(_seed(seed, gi, 0)),
                                         routing))
    for gi, (task, f) in enumerate(zip(tasks, futs)):
        for seq in f.result().sequences:
            ep = env.start(task)
            r = Rollout(ep, [0.0] * len(ep.tokens))
            start = len(ep.tokens)
            r.add_turn(seq, env.step(ep, list(seq.tokens)), start)
            rollouts.append(r)
    turn = 1
    while True:
        active = [i for i, r in enumerate(rollouts) if not r.episode.done]
        if not active:
            break
        futs = [sampler.sample_async(ModelInput.from_ints(rollouts[i].episode.tokens), 1, params(_seed(seed, i, turn)),
                                     routing) for i in active]
        for i, f in zip(active, futs):
            seq = f.result().sequences[0]
            r = rollouts[i]
            start = len(r.episode.tokens)
            r.add_turn(seq, env.step(r.episode, list(seq.tokens)), start)
        turn += 1
    for r in rollouts:
        r.reward = env.reward(r.episode)
    return rollouts


def gspo_data(rollouts: list[Rollout], advantages: list[float]) -> list[Datum]:
    """One Datum per episode: position i predicts token i + 1; weights 1 at the model's tokens; the recorded
    routing of the positions that produced them, when the rollouts carry it (-1: route freely)."""
    B = len(rollouts)
    out = []
    for r, a in zip(rollouts, advantages):
        toks, mask = r.episode.tokens, r.episode.model_mask
        n = max(sum(mask[1:]), 1)
        inputs = {"target_tokens": toks[1:], "weights": [1.0 if m else 0.0 for m in mask[1:]],
                  "logprobs": r.logprobs[1:], "advantages": [a / (n * B) if m else 0.0 for m in mask[1:]]}
        if r.routed:
            layers = next(iter(r.routed.values()))
            free = [[-1] * len(layers[0])] * len(layers)
            inputs["routed_experts"] = [r.routed.get(i, free) for i in range(len(toks) - 1)]
        out.append(Datum(ModelInput.from_ints(toks[:-1]), inputs))
    return out


def gspo_update(tc: TrainingClient, cfg: JobConfig, update: int, env: CalculatorEnv, max_data: int) -> dict:
    """One GSPO update of the calculator task through the service; returns the update's metrics row."""
    from k3.rl import group_advantages   # torch: only here (the client itself does not need it)
    import torch

    r = cfg.rollout
    t0 = time.perf_counter()
    sampler = tc.save_weights_and_get_sampling_client(f"u{update}")
    tasks = train_tasks(cfg.rl.train_seed * 1000 + update, r.tasks_per_update)
    rollouts = sample_episodes(sampler, env, tasks, r.group_size, temperature=r.temperature, top_p=r.top_p,
                               top_k=r.top_k, max_turn_tokens=r.max_turn_tokens, seed=cfg.rl.train_seed * 7919 + update,
                               routing=cfg.rl.router_replay)
    rewards = torch.tensor([x.reward for x in rollouts])
    adv = group_advantages(rewards, group_size=r.group_size).tolist()
    data = gspo_data(rollouts, adv)
    loss, tokens = 0.0, 0
    for i in range(0, len(data), max_data):
        fb = tc.forward_backward(data[i:i + max_data], "gspo",
                                 {"eps_low": cfg.rl.eps_low, "eps_high": cfg.rl.eps_high})
        loss += fb.metrics["loss"]
        tokens += int(fb.metrics["num_tokens"])
    step = tc.optim_step(AdamParams(learning_rate=cfg.rl.lr, beta1=0.9, beta2=0.999, eps=1e-8,
                                    grad_clip_norm=cfg.rl.max_grad_norm))
    return {"update": update, "reward": float(rewards.mean()), "loss": loss, "trained_tokens": tokens,
            "samples": len(rollouts), "grad_norm": step.metrics["grad_norm"], "step": step.step,
            "elapsed_s": time.perf_counter() - t0}


def heldout_reward(tc: TrainingClient, cfg: JobConfig, env: CalculatorEnv, name: str) -> float:
    r = cfg.rollout
    sampler = tc.save_weights_and_get_sampling_client(name)
    outs = sample_episodes(sampler, env, heldout_tasks()[: cfg.eval.heldout], cfg.eval.samples,
                           temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_turn_tokens=r.max_turn_tokens,
                           seed=99991)
    return sum(o.reward for o in outs) / len(outs)


def run_serverless_rl(cfg: JobConfig, url: str, out: Path, updates: int | None = None, *, api_key: str | None = None,
                      progress: bool = True) -> dict:
    """The GSPO loop through the service at `url` (a new LoRA session of rank `rl.lora_rank`)."""
    cfg.validate()
    out.mkdir(parents=True, exist_ok=True)
    service = ServiceClient(url, api_key=api_key)
    try:
        info = service.get_server_capabilities()
    except httpx.HTTPError as e:
        raise ConnectionError(f"--serverless {url}: cannot reach the service ({type(e).__name__}: {e})") from None
    tc = service.create_lora_training_client(info["base_model"], rank=cfg.rl.lora_rank, alpha=cfg.rl.lora_alpha,
                                             seed=cfg.rl.train_seed)
    env = CalculatorEnv()
    t0 = time.perf_counter()
    base = heldout_reward(tc, cfg, env, "base") if cfg.eval.heldout else None
    rows = []
    with open(out / "metrics.jsonl", "w") as log:
        for u in range(1, (updates or cfg.updates) + 1):
            row = gspo_update(tc, cfg, u, env, info["max_data"])
            if cfg.eval.heldout and (u % cfg.eval.every == 0 or u == (updates or cfg.updates)):
                row["heldout_reward"] = heldout_reward(tc, cfg, env, f"eval{u}")
            rows.append(row)
            log.write(json.dumps(row) + "\n")
            log.flush()
            if progress:
                print(f"update {u}: reward {row['reward']:.3f} loss {row['loss']:.4f} "
                      f"({row['elapsed_s']:.1f} s)", flush=True)
    summary = {"updates": len(rows), "session_id": tc.session_id, "server": url, "base_model": info["base_model"],
               "base_heldout_reward": base, "final_heldout_reward": rows[-1].get("heldout_reward"),
               "wall_s": time.perf_counter() - t0}
    (out / "summary.json").write_text(json.dumps({"summary": summary, "config": asdict(cfg)}, indent=2))
    service.close()
    return summary
