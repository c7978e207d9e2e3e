"""Train the EAGLE3-style draft head (drafter.py) on the target's own rollouts of the calculator task.

1. Rollouts: the target (the job's SFT base) samples G episodes of each of `tasks` training tasks through the
   embedded engine (k3.jobs.episodes.run_episodes, temperature 1).
2. Teacher-forced target forward over every episode, with FeatureCapture: features F[t] and the target's logits.
3. The head learns, from F[t] and the tokens x[t+1..t+j], the target's next-token distribution at t+j for
   j = 1..unroll (its own hidden fed back after step 1, as at draft time): KL(target || head) per step.
Cached under `cache_dir/drafter-<key>` (key: the SFT base's key and these settings), like the SFT base.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from k3.model import K3ForCausalLM
from k3.rollout.spec.drafter import META, WEIGHTS, DraftHead, FeatureCapture, save_drafter


@dataclass(frozen=True)
class DrafterTrainConfig:
    tasks: int = 96            # training tasks rolled out (distinct from the SFT seed's first tasks: seed below)
    group: int = 4             # samples per task
    max_turn_tokens: int = 16
    steps: int = 600
    batch: int = 256           # positions per step
    unroll: int = 3            # draft steps trained (the engine's default draft length)
    lr: float = 3e-3
    seed: int = 7

    def validate(self) -> None:
        for name in ("tasks", "group", "max_turn_tokens", "steps", "batch", "unroll"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"drafter.{name}: must be an integer >= 1, got {v!r}")
        if not self.lr > 0:
            raise ValueError(f"drafter.lr: must be > 0, got {self.lr!r}")


def drafter_key(sft_key: str, tcfg: DrafterTrainConfig) -> str:
    blob = json.dumps({"sft": sft_key, "drafter": asdict(tcfg)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def rollout_sequences(target: K3ForCausalLM, job_cfg, tcfg: DrafterTrainConfig) -> list[list[int]]:
    from k3.envs import CalculatorEnv
    from k3.envs.calc_task import train_tasks
    from k3.jobs.config import engine_config
    from k3.jobs.episodes import run_episodes
    from k3.rollout import Engine
    env = CalculatorEnv()
    eng = Engine(target, prefix_cache=True, config=engine_config(job_cfg))
    rs = run_episodes(eng, env, train_tasks(tcfg.seed, tcfg.tasks), tcfg.group, temperature=1.0, top_p=1.0,
                      top_k=0, max_turn_tokens=tcfg.max_turn_tokens, seed=tcfg.seed)
    return [list(r.episode.tokens) for r in rs]


@torch.no_grad()
def target_features(target: K3ForCausalLM, seqs: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence: (features [L, 3d] fp32, the target's log-probs [L, vocab] fp32), teacher forced."""
    out = []
    with FeatureCapture(target) as cap:
        for s in seqs:
            logits = target(torch.tensor([s]), use_cache=False).logits[0]
            out.append((cap.features()[0], torch.log_softmax(logits.float(), -1)))
    return out


def train_head(target: K3ForCausalLM, data: list[tuple[list[int], torch.Tensor, torch.Tensor]],
               tcfg: DrafterTrainConfig) -> tuple[DraftHead, dict]:
    """data: (tokens, features, target log-probs) per sequence. Returns the head and training figures."""
    g = torch.Generator().manual_seed(tcfg.seed)
    torch.manual_seed(tcfg.seed)
    U = tcfg.unroll
    index = [(i, t) for i, (toks, _, _) in enumerate(data) for t in range(len(toks) - U - 1)]
    if not index:
        raise ValueError("drafter: rollouts too short to train on")
    head = DraftHead(target.config.hidden_size)
    emb = target.model.embed_tokens.weight.detach().float()
    opt = torch.optim.AdamW(head.parameters(), lr=tcfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / tcfg.steps))
    losses = []
    for step in range(tcfg.steps):
        pick = torch.randint(0, len(index), (tcfg.batch,), generator=g).tolist()
        feats = torch.stack([data[index[p][0]][1][index[p][1]] for p in pick])
        h = head.fuse(feats)
        loss = 0.0
        for j in range(1, U + 1):
            toks = torch.tensor([data[index[p][0]][0][index[p][1] + j] for p in pick])
            h = head.step(h, emb[toks])
            want_log = torch.stack([data[index[p][0]][2][index[p][1] + j] for p in pick])
            want = want_log.exp()
            # KL(target || head): the soft cross-entropy less the target's entropy (its floor)
            kl = (want * (want_log - torch.log_softmax(head.logits(target, h), -1))).sum(-1)
            loss = loss + kl.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item() / U)
    return head.eval(), {"kl_first": losses[0], "kl_last": sum(losses[-20:]) / min(20, len(losses)),
                         "positions": len(index)}


def default_drafter_dir(job_cfg, tcfg: DrafterTrainConfig | None = None) -> Path:
    """Where `ensure_drafter` caches the drafter of the job's SFT base."""
    from k3.jobs.sft import sft_key
    return Path(job_cfg.sft.cache_dir) / f"drafter-{drafter_key(sft_key(job_cfg), tcfg or DrafterTrainConfig())}"


def ensure_drafter(job_cfg, tcfg: DrafterTrainConfig | None = None, progress: bool = True) -> tuple[Path, bool]:
    """The cached drafter for the job's SFT base: (directory, whether it was trained now)."""
    from k3.jobs.sft import ensure_base
    tcfg = tcfg or DrafterTrainConfig()
    tcfg.validate()
    out = default_drafter_dir(job_cfg, tcfg)
    if (out / WEIGHTS).exists() and (out / META).exists():
        return out, False
    base, _ = ensure_base(job_cfg, progress)
    target = K3ForCausalLM.from_pretrained(base).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    t0 = time.perf_counter()
    seqs = rollout_sequences(target, job_cfg, tcfg)
    feats = target_features(target, seqs)
    head, figures = train_head(target, [(s, f, lp) for s, (f, lp) in zip(seqs, feats)], tcfg)
    figures.update(sequences=len(seqs), seconds=round(time.perf_counter() - t0, 1))
    if progress:
        print(f"drafter: {len(seqs)} rollouts, {figures['positions']} positions, KL to the target "
              f"{figures['kl_first']:.3f} -> {figures['kl_last']:.3f} ({figures['seconds']} s)")
    save_drafter(head, out, {"base": str(base), "train": asdict(tcfg), "figures": figures})
    return out, True
