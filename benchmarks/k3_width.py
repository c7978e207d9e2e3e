"""The GPU section's target and drafter (benchmarks/spec_decode.py, decode_profile.py): a K3-width model with few
layers (K3's hidden size, heads and experts' widths; 4 layers, 16 experts), random or trained on the device on the
calculator demonstrations, and its trained drafter (`k3.rollout.spec.train_drafter`) on the model's own greedy
rollouts."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from k3.rollout import Engine, SamplingParams


def k3_width_config():
    import dataclasses
    from k3.config import K3Config
    base = K3Config.preset("k3")
    return dataclasses.replace(base, num_hidden_layers=4, num_experts=16, num_experts_per_token=8,
                               linear_attn_config={**base.linear_attn_config, "kda_layers": [1, 2, 3],
                                                   "full_attn_layers": [4]},
                               attn_res_block_size=2)


def _frozen_bf16(model):
    for p in model.parameters():   # a frozen target (the drafter's training must not reach it)
        p.requires_grad_(False)
    return model.to(torch.bfloat16).eval()


def k3_width_model():
    from k3.model import K3ForCausalLM
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = K3ForCausalLM(k3_width_config())
    return _frozen_bf16(model)


def sft_k3_width_model(steps: int, lr: float, budget_s: float, batch: int = 32, config=None,
                       device: str = "cuda", freeze_routed_experts: bool = False, micro_batch: int | None = None,
                       bf16_frozen_tables: bool = False) -> tuple[object, dict]:
    """The K3-width model trained on the main job's calculator demonstrations (k3.jobs.sft's rows and loss, the
    system prompt's state computed once per step without gradient), on the device: fp32 weights and AdamW, the
    token embedding and the lm_head frozen at their random init (their 163,840 rows would be 2.3 B more trained
    parameters; the other 4.4 B learn to use them), linear warm-up over 10 steps, until `steps` or `budget_s`.
    Then bf16 and frozen, as the benchmark serves it. `freeze_routed_experts`: the routed experts' weights stay at
    their random init too: 1.58 B parameters fewer to train, ~18 GiB fewer gradients and AdamW moments, meant
    to let the training fit an 80 GB H100 (training everything does not); a different target, so its figures are
    a series of their own. Training everything within an 80 GB H100 instead: `micro_batch` forwards and
    backpropagates each step's rows that many at a time (`k3.jobs.sft.sft_step`'s `micro_batch`) and
    `bf16_frozen_tables` holds the frozen embedding and lm_head in bf16 while training (`_bf16_tables`; the served
    target is bf16 anyway), which changes the trained weights in the last bits: close to the full-batch target,
    not its bits. Returns (model, training figures)."""
    import random
    from k3.envs import CalculatorEnv, train_tasks
    from k3.jobs.config import SFTSection
    from k3.jobs.sft import sft_step
    from k3.model import K3ForCausalLM
    if micro_batch is not None and micro_batch < 1:   # before any work
        raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = K3ForCausalLM(config or k3_width_config())
    model.model.embed_tokens.weight.requires_grad_(False)
    model.lm_head.weight.requires_grad_(False)
    if freeze_routed_experts:
        for name, p in model.named_parameters():
            if ".experts." in name and ".shared_experts." not in name:
                p.requires_grad_(False)
    hooks = _bf16_tables(model) if bf16_frozen_tables else []
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=device == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 10))
    env, sft, rng = CalculatorEnv(), SFTSection(), random.Random(1)
    tasks = train_tasks(1, 4096)
    peak = (lambda: torch.cuda.max_memory_allocated() / 2**30) if device == "cuda" else (lambda: 0.0)
    losses, done = [], 0
    for i in range(steps):
        if time.perf_counter() - t0 > budget_s:
            break
        losses.append(sft_step(model, env, tasks, rng, sft, batch, params, opt, micro_batch).item())
        sched.step()
        done = i + 1
        if i % 20 == 0:
            print(f"sft step {i}: loss {losses[-1]:.3f}, {time.perf_counter() - t0:.0f} s, peak {peak():.1f} GiB",
                  flush=True)
    trained = sum(p.numel() for p in params)
    for hook in hooks:
        hook.remove()
    del opt, params
    model.zero_grad(set_to_none=True)
    fig = {"steps": done, "batch": batch, "lr": lr, "trained_parameters": trained,
           "routed_experts_frozen": freeze_routed_experts, "micro_batch": min(micro_batch or batch, batch),
           "bf16_frozen_tables": bf16_frozen_tables, "loss_first": losses[0] if losses else None,
           "loss_last20": sum(losses[-20:]) / max(1, len(losses[-20:])), "seconds": round(time.perf_counter() - t0, 1),
           "peak_gib": round(peak(), 1)}
    model = _frozen_bf16(model)
    if device == "cuda":
        torch.cuda.empty_cache()
    return model, fig


def _bf16_tables(model) -> list:
    """The frozen token embedding and lm_head in bf16 for training (half their fp32 bytes: 4.4 GiB at K3 width),
    the fp32 model around them: hooks cast the embedding's output to fp32, the lm_head's input to bf16 and its
    logits to fp32. Returns the hooks' handles (removed once trained)."""
    embed, head = model.model.embed_tokens, model.lm_head
    if embed.weight.requires_grad or head.weight.requires_grad:
        raise ValueError("bf16_frozen_tables: the embedding and lm_head must be frozen")
    embed.to(torch.bfloat16)
    head.to(torch.bfloat16)
    return [embed.register_forward_hook(lambda module, args, out: out.float()),
            head.register_forward_pre_hook(lambda module, args: (args[0].to(torch.bfloat16), *args[1:])),
            head.register_forward_hook(lambda module, args, out: out.float())]


def gpu_drafter(model, out_dir: Path, tasks: int, steps: int, sp: SamplingParams, episodes: bool
                ) -> tuple[Path, dict]:
    """The trained drafter for the K3-width GPU model, as `k3 train-drafter` trains the CPU one: the target's own
    greedy rollouts of calculator training tasks -- `episodes`: whole episodes, every turn (k3.jobs.episodes, the
    main job's rollouts, greedy, turns of at most `sp.max_tokens`); else turn 0 sampled with `sp` -- teacher-forced
    features and log-probs over the draft vocabulary (the rollouts' tokens), KL-trained head over it
    (train_drafter.train_head). Each sequence is kept from the prompt's second-to-last position (the first draft
    starts at its last), and the head trains where the model generated the next token."""
    from k3.envs import CalculatorEnv
    from k3.envs.calc_task import train_tasks
    from k3.jobs.episodes import run_episodes
    from k3.rollout.spec.drafter import save_drafter
    from k3.rollout.spec.train_drafter import DrafterTrainConfig, draft_vocabulary, target_features, train_head
    t0 = time.perf_counter()
    env = CalculatorEnv()
    task_list = train_tasks(7, tasks)
    prompts = [env.prompt(t) for t in task_list]
    if episodes:
        eng = Engine(model, prefix_cache=True, decode_batch=64, max_running=128, device_states=512,
                     device_pages=16384)
        rs = run_episodes(eng, env, task_list, 1, temperature=0.0, top_p=1.0, top_k=0, max_turn_tokens=sp.max_tokens,
                          seed=7)
        seqs = [list(r.episode.tokens) for r in rs]
        masks = [list(r.episode.model_mask) for r in rs]
    else:
        outs = Engine(model, prefix_cache=False, decode_batch=16, max_running=32, device_states=64,
                      device_pages=8192).generate(prompts, sp)
        seqs = [p + c.token_ids for p, c in zip(prompts, outs)]
        masks = [[i >= len(p) for i in range(len(q))] for p, q in zip(prompts, seqs)]
    tcfg = DrafterTrainConfig(steps=steps, batch=256, unroll=3)
    vocab = draft_vocabulary(seqs, tcfg.draft_vocab)
    starts = [len(p) - 2 for p in prompts]
    feats = target_features(model, seqs, starts, vocab)
    data = [(q[a:], f, lp, m[a:]) for q, m, a, (f, lp) in zip(seqs, masks, starts, feats)]
    del feats
    head, figures = train_head(model, data, tcfg, vocab)
    generated = [sum(m) for m in masks]
    figures.update(sequences=len(seqs), seconds=round(time.perf_counter() - t0, 1), episodes=episodes,
                   distinct_continuations=len({tuple(q[len(p):]) for p, q in zip(prompts, seqs)}),
                   draft_vocab=len(vocab), mean_generated_tokens=sum(generated) / len(generated))
    save_drafter(head, out_dir, {"base": "k3-width GPU benchmark model", "train": vars(tcfg), "figures": figures,
                                 "draft_vocab": vocab})
    return out_dir, figures
