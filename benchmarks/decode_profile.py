"""Where a decode step's time goes on the GPU (stdout only, no results JSON): the K3-width model of
benchmarks/spec_decode.py, plain decoding at batch 1 / 8 / 32 and a speculative step, under cProfile (host
functions by own time) and torch.profiler (device kernels and host ops). `--sft-probe N`: N calculator SFT steps of a
trainable K3-width model on the device (step time, peak memory, loss), to size the trained GPU target.

    . benchmarks/device_env.sh && python3 -m benchmarks.decode_profile --batches 1,8,32 --sft-probe 5
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from benchmarks.spec_decode import _DecodeTimer, k3_width_model
from k3.rollout import Engine, SamplingParams
from k3.rollout.spec import SpecConfig


def _prompts(n):
    from k3.envs import CalculatorEnv
    from k3.envs.calc_task import heldout_tasks
    env = CalculatorEnv()
    return [env.prompt(t) for t in heldout_tasks()][:n]


def profile_decode(model, batch: int, spec: SpecConfig | None, tokens: int) -> None:
    prompts = _prompts(batch)
    sp = SamplingParams(temperature=0.0, max_tokens=tokens)

    def run():
        eng = Engine(model, prefix_cache=False, speculative=spec, decode_batch=batch, max_running=max(32, batch),
                     device_states=max(256, 2 * batch + 2), device_pages=8192)
        timer = _DecodeTimer(eng)
        eng.generate(prompts, sp)
        return timer, eng
    run()   # kernel builds
    timer, eng = run()
    n = eng.stats["spec_emitted_tokens"] if spec is not None else timer.tokens
    steps = eng.stats["spec_verifies"] / max(batch, 1) if spec is not None else tokens - 1
    print(f"== batch {batch} spec {spec and spec.shape}: decode {timer.seconds * 1e3:.1f} ms for {n} tokens, "
          f"{timer.seconds / max(steps, 1) * 1e3:.2f} ms per step", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    run()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as tp:
        run()
    print(tp.key_averages().table(sort_by="cuda_time_total", row_limit=25), flush=True)
    print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)


def sft_probe(steps: int, lr: float) -> None:
    import dataclasses
    import random
    from k3.config import K3Config
    from k3.envs import CalculatorEnv, train_tasks
    from k3.jobs.config import SFTSection
    from k3.jobs.sft import demonstration_row, masked_next_token_loss, pack
    from k3.model import K3ForCausalLM, K3State
    base = K3Config.preset("k3")
    cfg = dataclasses.replace(base, num_hidden_layers=4, num_experts=16, num_experts_per_token=8,
                              linear_attn_config={**base.linear_attn_config, "kda_layers": [1, 2, 3],
                                                  "full_attn_layers": [4]}, attn_res_block_size=2)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = K3ForCausalLM(cfg)
    model.model.embed_tokens.weight.requires_grad_(False)
    model.lm_head.weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)
    env = CalculatorEnv()
    rng = random.Random(1)
    tasks = train_tasks(1, 4096)
    sft = SFTSection()
    system = torch.tensor([env.system], device="cuda")
    S = len(env.system)
    for i in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        eps = [demonstration_row(env, tasks, rng, sft) for _ in range(32)]
        with torch.no_grad():
            _, prefix = model.extend(system)
        ids, mask = pack([e.tokens[S:] for e in eps], [e.model_mask[S:] for e in eps])
        loss = masked_next_token_loss(model, ids.cuda(), mask.cuda(), K3State.concat([prefix] * len(eps)))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        torch.cuda.synchronize()
        print(f"sft step {i}: {time.perf_counter() - t:.2f} s, loss {loss.item():.3f}, tokens {ids.numel()}, "
              f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB, system {S}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--spec", action="store_true", help="also an n-gram batched chain-3 step at each batch")
    ap.add_argument("--sft-probe", type=int, default=0)
    ap.add_argument("--lr", type=float, default=3e-4)
    a = ap.parse_args()
    if a.batches:
        model = k3_width_model()
        for b in (int(x) for x in a.batches.split(",")):
            profile_decode(model, b, None, a.tokens)
            if a.spec:
                profile_decode(model, b, SpecConfig(draft_len=3, verify="batched"), a.tokens)
        del model
        torch.cuda.empty_cache()
    if a.sft_probe:
        sft_probe(a.sft_probe, a.lr)


if __name__ == "__main__":
    main()
