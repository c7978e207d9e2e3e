"""Warm start (`k3 sft`): train the tiny K3 on synthetic calculator demonstrations that contain deliberate mistakes,
to a base policy that knows how to use the tool but rarely decides to (held-out reward around 0.3). The result is
cached under `cache_dir/sft-<key>/` (config.json + model.safetensors + meta.json) and reused by later runs. The key
covers the config and the code that trains the base (`sft_code_digest`): the same config trained by other code is
another base (a checkout's `.cache/k3` once kept a base from an earlier commit whose weights differed from the one
the current code trains, so its main job started from another policy than a fresh clone's)."""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from k3.config import K3Config
from k3.envs import CalculatorEnv, Episode, Task, train_tasks
from k3.jobs.config import JobConfig, SFTSection
from k3.model import K3ForCausalLM, K3State


def pack(sequences: list[list[int]], masks: list[list[bool]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists into ids [B, L] and a bool mask [B, L]."""
    L = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), L), pad_id, dtype=torch.long)
    mask = torch.zeros(len(sequences), L, dtype=torch.bool)
    for i, (s, m) in enumerate(zip(sequences, masks)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(m)] = torch.tensor(m)
    return ids, mask


def masked_next_token_loss(model: K3ForCausalLM, ids: torch.Tensor, mask: torch.Tensor,
                           prefix: K3State | None = None) -> torch.Tensor:
    """Mean cross-entropy of the tokens where mask is set (the model's own turns), predicted from the prefix.
    `prefix` is a decode state the rows continue from (the shared system prompt, computed without gradient)."""
    logits = model(ids[:, :-1], prefix, use_cache=False).logits
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1), reduction="none")
    m = mask[:, 1:].reshape(-1).float()
    return (ce * m).sum() / m.sum().clamp(min=1.0)


def demonstration_row(env: CalculatorEnv, tasks: list[Task], rng: random.Random, sft: SFTSection) -> Episode:
    """One SFT row. With prob. `p_copy` a tool-use demonstration whose first model token (the decision to call the
    tool) is left out of the loss: it teaches the tool's mechanics (copy the expression into the call, copy the
    result into the answer) without changing how often the base decides to call. Otherwise a demonstration from
    the `p_tool` / `p_slip` mixture, decision included. The base thus uses the tool rarely but fairly well: the
    improvement RL can find is to call it more often."""
    mechanics_only = rng.random() < sft.p_copy
    task = tasks[rng.randrange(len(tasks))]
    ep = env.demonstration(task, rng, p_tool=1.0 if mechanics_only else sft.p_tool, p_slip=sft.p_slip)
    if mechanics_only:
        ep.model_mask[len(env.prompt(task))] = False
    return ep


# What the SFT base's bits depend on beyond the config: the model and its ops (k3.model -> k3_kernels' references),
# the demonstrations (k3.envs), this loop and the config classes (k3.jobs, k3.config).
_SFT_CODE = (("k3", ("model", "envs", "jobs", "config.py")), ("k3_kernels", ("",)))


def sft_code_digest() -> str:
    """sha256 over the bytes (and package-relative paths) of the sources in `_SFT_CODE`."""
    import importlib

    digest = hashlib.sha256()
    for package, parts in _SFT_CODE:
        root = Path(importlib.import_module(package).__file__).parent
        for part in parts:
            path = root / part
            for f in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
                digest.update(f"{package}/{f.relative_to(root).as_posix()}\0".encode())
                digest.update(f.read_bytes())
    return digest.hexdigest()


def sft_key(cfg: JobConfig) -> str:
    blob = json.dumps({"model": asdict(cfg.model), "sft": {k: v for k, v in asdict(cfg.sft).items()
                                                            if k != "cache_dir"}, "code": sft_code_digest()},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def train_sft(cfg: JobConfig, progress: bool = True) -> K3ForCausalLM:
    torch.manual_seed(cfg.model.seed)
    model = K3ForCausalLM(K3Config.preset(cfg.model.preset))
    env = CalculatorEnv()
    if len(env.tok) > model.config.vocab_size:
        raise ValueError(f"model.preset: vocabulary {model.config.vocab_size} is smaller than the tokenizer's "
                         f"{len(env.tok)}")
    rng = random.Random(cfg.sft.seed)
    tasks = train_tasks(cfg.sft.seed, 4096)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.sft.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / cfg.sft.steps))
    bar = tqdm(range(cfg.sft.steps), desc="sft", disable=not progress)
    for _ in bar:
        loss = sft_step(model, env, tasks, rng, cfg.sft, cfg.sft.batch_size, params, opt)
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    return model.eval()


def sft_step(model: K3ForCausalLM, env: CalculatorEnv, tasks: list[Task], rng: random.Random, sft: SFTSection,
             batch_size: int, params: list[torch.nn.Parameter], opt: torch.optim.Optimizer,
             micro_batch: int | None = None) -> torch.Tensor:
    """One SFT step on `batch_size` demonstration rows (on the model's device): masked next-token loss, gradients
    clipped to norm 1 over `params` (the trained ones), one optimizer step. Returns the loss. `micro_batch`: the
    rows forwarded and backpropagated that many at a time (the activations of that many rows at once), each part's
    masked mean weighted by its share of the step's masked tokens: the whole step's loss and gradient up to
    summation order (None: all rows at once)."""
    if micro_batch is not None and micro_batch < 1:
        raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
    device = next(model.parameters()).device
    eps = [demonstration_row(env, tasks, rng, sft) for _ in range(batch_size)]
    S = len(env.system)
    # every demonstration starts with the same system prompt: compute its state once per step (no gradient
    # through it) and train on the rest of each episode from there
    with torch.no_grad():
        _, prefix = model.extend(torch.tensor([env.system], device=device))
    part_rows = min(micro_batch or batch_size, batch_size)
    if part_rows < batch_size:
        # each row's tokens in the loss (masked_next_token_loss predicts positions 1..L-1 of the rows it packs)
        counted = [sum(e.model_mask[S + 1:]) for e in eps]
        total = max(sum(counted), 1)
    opt.zero_grad(set_to_none=True)
    loss = None
    for lo in range(0, batch_size, part_rows):
        part = eps[lo:lo + part_rows]
        ids, mask = pack([e.tokens[S:] for e in part], [e.model_mask[S:] for e in part])
        part_loss = masked_next_token_loss(model, ids.to(device), mask.to(device), K3State.concat([prefix] * len(part)))
        if part_rows < batch_size:
            part_loss = part_loss * (sum(counted[lo:lo + part_rows]) / total)
        part_loss.backward()
        loss = part_loss.detach() if loss is None else loss + part_loss.detach()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return loss


def ensure_base(cfg: JobConfig, progress: bool = True) -> tuple[Path, bool]:
    """The cached SFT base for this config: (directory, whether it was trained now)."""
    out = Path(cfg.sft.cache_dir) / f"sft-{sft_key(cfg)}"
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out, False
    model = train_sft(cfg, progress)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    (tmp / "meta.json").write_text(json.dumps({"sft": asdict(cfg.sft), "model": asdict(cfg.model)}, indent=2))
    if out.exists():
        import shutil
        shutil.rmtree(out)
    tmp.rename(out)
    return out, True
