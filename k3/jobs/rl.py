"""`k3 rl`: GSPO with LoRA (or full parameters) on the multi-turn calculator task, end to end on one machine.

    rollout (embedded engine, G samples per task, multi-turn, prefix cache) -> rubric rewards -> group advantages
    -> GSPO learner with Router Replay -> XOR-delta sync of the new policy weights to the engine
    -> held-out evaluation every k updates.

The engine holds its own copy of the model: the trainer's weights reach it only through `k3.sync` payloads, and
after every sync the engine's weights are checked bit for bit against the learner's."""
from __future__ import annotations

import hashlib
import json
import resource
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from k3.envs import CalculatorEnv, heldout_tasks, train_tasks
from k3.jobs.config import JobConfig, JobConfigError, engine_config, max_episode_tokens
from k3.jobs.episodes import Rollout, run_episodes
from k3.jobs.report import MetricsLog, plot, summary_table
from k3.jobs.sft import ensure_base
from k3.lora import LoRAConfig, LoRAManager
from k3.model import K3ForCausalLM
from k3.rl import Batch, Learner, LearnerConfig, group_advantages
from k3.rl.learner import POLICY_ADAPTER
from k3.rollout import Engine
from k3.rollout.backend import load_backend, state_digest
from k3.sync import WeightPublisher, WeightReceiver, states_equal

PUBLISH_DTYPE = torch.bfloat16


def build_batch(rollouts: list[Rollout], advantages: torch.Tensor, n_moe: int, top_k: int) -> Batch:
    """Right-padded learner batch; routed experts recorded by the engine for the model's tokens, -1 elsewhere."""
    L = max(len(r.episode.tokens) for r in rollouts)
    B = len(rollouts)
    tokens = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.bool)
    logp = torch.zeros(B, L)
    routed = torch.full((B, L, n_moe, top_k), -1, dtype=torch.long)
    for i, r in enumerate(rollouts):
        n = len(r.episode.tokens)
        tokens[i, :n] = torch.tensor(r.episode.tokens)
        mask[i, :n] = torch.tensor(r.episode.model_mask)
        logp[i, :n] = torch.tensor(r.logprobs)
        # r.routed[p] is the routing of position p - 1, the learner's position that reads token p - 1
        for p, e in enumerate(r.routed):
            if e is not None:
                routed[i, p - 1] = e
    return Batch(tokens=tokens, response_mask=mask, rollout_logp=logp, advantages=advantages.float(),
                 routed_experts=routed)


class RLJob:
    def __init__(self, cfg: JobConfig, out: Path, progress: bool = True) -> None:
        cfg.validate()   # a config built in code gets the same checks as `load_config`, before any work
        backend_cls = load_backend(cfg.rollout.backend)   # a missing plugin fails here, before any work
        if backend_cls is not None and cfg.rollout.speculative != "off":
            raise JobConfigError(f"rollout.speculative: {cfg.rollout.speculative!r} runs in the embedded engine only; "
                                 f"rollout.backend={cfg.rollout.backend!r} needs 'off'")
        self.cfg, self.out, self.progress = cfg, out, progress
        out.mkdir(parents=True, exist_ok=True)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.env = CalculatorEnv()
        base_dir, self.sft_trained = ensure_base(cfg, progress)
        torch.manual_seed(cfg.rl.train_seed)
        trainer = K3ForCausalLM.from_pretrained(base_dir).to(self.device)
        serving = K3ForCausalLM.from_pretrained(base_dir).to(self.device)
        self.lora_cfg = (LoRAConfig(rank=cfg.rl.lora_rank, alpha=cfg.rl.lora_alpha) if cfg.rl.mode == "lora"
                         else None)
        self.learner = Learner(trainer, LearnerConfig(lr=cfg.rl.lr, eps_low=cfg.rl.eps_low, eps_high=cfg.rl.eps_high,
                                                      router_replay=cfg.rl.router_replay, kl_coef=cfg.rl.kl_coef,
                                                      max_grad_norm=cfg.rl.max_grad_norm, lora=self.lora_cfg,
                                                      micro_batch_size=cfg.rl.micro_batch_size),
                               seed=cfg.rl.train_seed)
        self.adapter_id = POLICY_ADAPTER if self.lora_cfg is not None else None
        if self.lora_cfg is not None:  # the engine serves base + adapter, the adapter's weights arrive by sync
            self.serving_lora = LoRAManager(serving)
            self.serving_adapter = self.serving_lora.create(POLICY_ADAPTER, self.lora_cfg)
            self.serving_lora.activate(POLICY_ADAPTER)
        self.serving = serving
        # a chain id derived from the config, not a random one: its length in the payload header would make
        # delta_bytes differ by a byte or two between runs of the same config
        chain = hashlib.sha256(json.dumps(asdict(cfg), sort_keys=True).encode()).hexdigest()[:32]
        self.publisher = WeightPublisher(full_every=cfg.sync.full_every, level=cfg.sync.zstd_level, chain=chain)
        first = self.publisher.publish(self._published(), version=0)
        self.receiver = WeightReceiver.from_payload(first)
        self._load_serving(self.receiver.state_dict())
        # the engine config load_config already checked (k3.jobs.config.engine_config: one place for both)
        self.engine = Engine(serving, prefix_cache=cfg.rollout.prefix_cache, config=engine_config(cfg))
        # rollout.backend != "embedded": a framework's engine (k3.rollout.backend) does the rollouts; it loads the
        # SFT base from disk and receives the policy only through k3.sync payloads, like the embedded one
        self.backend = None
        if backend_cls is not None:
            self.backend = backend_cls.launch(base_dir, max_model_len=max_episode_tokens(cfg.rollout.max_turn_tokens),
                                              seed=cfg.rl.train_seed)
            self.backend.start_sync(first, publish_dtype=PUBLISH_DTYPE, lora=self.lora_cfg,
                                    adapter_id=self.adapter_id)
            self.engine = self.backend
        self.model_bytes = sum(v.numel() * 2 for v in trainer.state_dict().values())  # bf16 full checkpoint

    # ------------------------------------------------------------------ weights
    def _published(self) -> dict[str, torch.Tensor]:
        """The policy as published to rollout: bf16 copies of the learner's fp32 master weights (the adapter in
        LoRA mode, every weight in full mode). Small updates leave most bf16 values unchanged: small XOR deltas."""
        src = self.learner.adapter_state_dict() if self.lora_cfg is not None else self.learner.model.state_dict()
        return {k: v.detach().to(PUBLISH_DTYPE if v.is_floating_point() else v.dtype) for k, v in src.items()}

    def _load_serving(self, state: dict[str, torch.Tensor]) -> None:
        if self.lora_cfg is not None:
            self.serving_adapter.load_tensors({k: v.float() for k, v in state.items()})
        else:
            self.serving.load_state_dict(state)

    def _serving_state(self) -> dict[str, torch.Tensor]:
        """The engine's weights in the published dtype (exact: they were loaded from those values)."""
        src = self.serving_adapter.tensors() if self.lora_cfg is not None else self.serving.state_dict()
        return {k: v.detach().to(PUBLISH_DTYPE if v.is_floating_point() else v.dtype) for k, v in src.items()}

    def sync(self, version: int) -> tuple[int, int]:
        """Publish the learner's weights as version `version`, apply on the engine side; (payload, full) bytes."""
        state = self._published()
        payload = self.publisher.publish(state, version)
        full_bytes = sum(v.numel() * v.element_size() for v in state.values())
        if self.backend is not None:   # applied inside the backend's engine; proven by the digest of what it serves
            self.backend.apply_weight_payload(payload)
            if self.backend.weights_digest() != state_digest(state):
                raise RuntimeError(f"sync: {self.cfg.rollout.backend} engine weights differ from the published "
                                   f"ones after version {version}")
            return len(payload), full_bytes
        self.receiver.apply(payload)
        self._load_serving(self.receiver.state_dict())
        self.engine.update_weights(None, version)  # the receiver already wrote the weights; new cache scope
        if not states_equal(self._serving_state(), state):
            raise RuntimeError(f"sync: engine weights differ from the published ones after version {version}")
        return len(payload), sum(v.numel() * v.element_size() for v in state.values())

    def close(self) -> None:
        """Stop the rollout backend's engine (its processes), if any."""
        if self.backend is not None:
            self.backend.close()

    # ------------------------------------------------------------------ loop
    def evaluate(self, version: int) -> tuple[float, float]:
        """Mean reward on the held-out tasks (eval.samples sampled episodes each) and the share that called the tool."""
        r = self.cfg.rollout
        tasks = heldout_tasks()[: self.cfg.eval.heldout]
        outs = run_episodes(self.engine, self.env, tasks, self.cfg.eval.samples, temperature=r.temperature,
                            top_p=r.top_p, top_k=r.top_k, max_turn_tokens=r.max_turn_tokens, seed=99991,
                            adapter_id=self.adapter_id)
        return sum(o.reward for o in outs) / len(outs), _tool_rate(outs)

    def run(self, updates: int) -> dict:
        cfg, r = self.cfg, self.cfg.rollout
        log = MetricsLog(self.out / "metrics.jsonl")
        t0 = time.perf_counter()
        base_heldout, base_tool_rate = self.evaluate(0)
        n_moe, top_k = len(self.learner.model.moe_layer_ids), self.learner.model.config.num_experts_per_token
        bar = tqdm(range(1, updates + 1), desc="rl", disable=not self.progress)
        for u in bar:
            tasks = train_tasks(cfg.rl.train_seed * 1000 + u, r.tasks_per_update)
            stats0 = self.engine.cache_stats()
            rollouts = run_episodes(self.engine, self.env, tasks, r.group_size, temperature=r.temperature,
                                    top_p=r.top_p, top_k=r.top_k, max_turn_tokens=r.max_turn_tokens,
                                    seed=cfg.rl.train_seed * 7919 + u, adapter_id=self.adapter_id)
            stats1 = self.engine.cache_stats()
            rewards = torch.tensor([x.reward for x in rollouts])
            if not bool(((rewards >= 0) & (rewards <= 1)).all()):
                raise RuntimeError(f"rewards out of [0, 1]: {rewards.tolist()}")
            adv = group_advantages(rewards, group_size=r.group_size)
            batch = build_batch(rollouts, adv, n_moe, top_k).to(self.device)
            m = self.learner.forward_backward(batch)
            m |= self.learner.optim_step()
            delta_bytes, full_bytes = self.sync(u)
            hit = _hit_rate(stats0, stats1)
            row = {"update": u, "reward": float(rewards.mean()), "kl_k3": float(m["mismatch_k3_kl"]),
                   "max_abs_dlogp": float(m["max_abs_dlogp"]),
                   "cache_hit_rate": hit, "delta_bytes": delta_bytes, "full_bytes": full_bytes,
                   "model_bytes": self.model_bytes, "tool_rate": _tool_rate(rollouts), "loss": float(m["loss"]),
                   "grad_norm": float(m["grad_norm"]),
                   "clip_frac": float(m["clip_frac"]), "masked_frac": float(m["masked_frac"]),
                   "elapsed_s": time.perf_counter() - t0}
            if u % cfg.eval.every == 0 or u == updates:
                row["heldout_reward"], row["heldout_tool_rate"] = self.evaluate(u)
            log.write(row)
            bar.set_postfix(reward=f"{row['reward']:.3f}", kl=f"{row['kl_k3']:.1e}", hit=f"{hit:.3f}",
                            delta=f"{delta_bytes / 1024:.0f}K")
        rows = log.rows
        total = self.engine.cache_stats()
        final = rows[-1]["heldout_reward"]
        summary = {
            "updates": updates, "base_heldout_reward": base_heldout, "final_heldout_reward": final,
            "heldout_gain": final / base_heldout if base_heldout > 0 else float("inf"),
            "base_heldout_tool_rate": base_tool_rate, "final_heldout_tool_rate": rows[-1]["heldout_tool_rate"],
            "mean_kl_k3": sum(x["kl_k3"] for x in rows) / len(rows),
            "max_kl_k3": max(x["kl_k3"] for x in rows),
            "cache_hit_rate": _hit_rate(None, total),
            "mean_delta_bytes": sum(x["delta_bytes"] for x in rows) / len(rows),
            "full_bytes": rows[-1]["full_bytes"], "model_bytes": self.model_bytes,
            "delta_over_full": max(x["delta_bytes"] / x["full_bytes"] for x in rows),
            "delta_over_model": max(x["delta_bytes"] / x["model_bytes"] for x in rows),
            "mode": cfg.rl.mode, "device": self.device, "wall_s": time.perf_counter() - t0,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # this process; KiB on Linux
        }
        (self.out / "summary.json").write_text(json.dumps({"summary": summary, "config": asdict(cfg)}, indent=2))
        plot(rows, self.out / "rl.png", base_heldout)
        return summary


def _tool_rate(rollouts: list[Rollout]) -> float:
    """Share of episodes that called the calculator at least once."""
    return sum(bool(x.episode.calls) for x in rollouts) / len(rollouts)


def _hit_rate(before: dict | None, after: dict) -> float:
    hit = after["hit_tokens"] - (before["hit_tokens"] if before else 0)
    total = after["prompt_tokens"] - (before["prompt_tokens"] if before else 0)
    return hit / total if total else 0.0


def run_rl(cfg: JobConfig, out: Path, updates: int | None = None, progress: bool = True) -> dict:
    job = RLJob(cfg, out, progress)
    try:
        summary = job.run(updates or cfg.updates)
    finally:
        job.close()
    if progress:
        print(summary_table(summary))
        print(f"metrics: {out / 'metrics.jsonl'}  plot: {out / 'rl.png'}  summary: {out / 'summary.json'}")
    return summary
