"""Training step of a K3-width model with a few layers through the TorchTitan plugin's ModelSpec and parallelize_fn
(FSDP = 1: one device): tokens/s, MFU and peak memory, three kernel sets side by side in one process:

    ours       k3.model.ops as shipped (k3_kernels' Triton KDA / AttnRes / norm / SiTU kernels on CUDA)
    fla        the same model with KDA (chunk_kda) and AttnRes (fused_attnres) from fla-core 0.6.0
    reference  every op on its plain-torch reference (k3_kernels.*.naive), on the same device

TorchTitan's trainer does not import under the GPU machine's torch 2.11, so this script builds the model the way
the trainer does (ModelSpec.model.build() on meta -> parallelize_fn -> to_empty -> init_weights) and runs
forward + cross-entropy backward + AdamW itself. Step time: median of --steps timed steps after --warmup.
MFU = model FLOPs per token (get_nparams_and_flops) x tokens/s / the device's dense bf16 peak.

    python -m benchmarks.train_step                 # GPU (writes benchmarks/results/train_step.json)
    python -m benchmarks.train_step --smoke --out X # CPU, tiny shapes (checks the script; figures labelled CPU)
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from benchmarks._results import run_header, write_results
from k3.config import K3Config, _default_linear_attn
from k3.model import ops

PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12}  # dense bf16, NVIDIA datasheets


@dataclass(frozen=True)
class StepConfig:
    layers: int = 4
    experts: int = 32          # K3's top-16 routing over fewer experts (896 x 4 layers does not fit one H200)
    seq_len: int = 4096
    batch: int = 1
    steps: int = 10
    warmup: int = 3
    dtype: str = "bfloat16"
    smoke: bool = False


def model_config(sc: StepConfig) -> K3Config:
    """K3's published widths (hidden 7168, 96 KDA / 96 MLA heads, latent MoE) with `layers` layers (K3's 3:1
    KDA:MLA layout, last layer MLA) and `experts` experts; the smoke run uses the tiny preset."""
    if sc.smoke:
        return K3Config.preset("tiny").replace(num_hidden_layers=sc.layers,
                                               linear_attn_config=_scaled_lac(K3Config.preset("tiny"), sc.layers))
    k3 = K3Config.preset("k3")
    return k3.replace(num_hidden_layers=sc.layers, linear_attn_config=_scaled_lac(k3, sc.layers),
                      num_experts=sc.experts, num_expert_group=1, topk_group=1)


def _scaled_lac(cfg: K3Config, layers: int) -> dict:
    return {**cfg.linear_attn_config, **_default_linear_attn(layers),
            "num_heads": cfg.kda_num_heads, "head_dim": cfg.kda_head_dim}


@contextlib.contextmanager
def kernel_set(name: str):
    """Route k3.model.ops to one kernel set for the duration (restored after)."""
    saved = {k: getattr(ops, k) for k in ("_on_cuda", "kda_chunk", "block_attnres", "attnres_bank_row")}
    try:
        if name == "reference":
            ops._on_cuda = lambda x: False
        elif name == "fla":
            from fla.ops.attnres import fused_attnres
            from fla.ops.kda import chunk_kda

            def fla_kda(q, k, v, g, beta, initial_state=None, output_final_state=False):
                h0 = initial_state.float() if initial_state is not None else None
                return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=output_final_state)

            def fla_attnres(rows, partial, query, norm_weight, eps, output_norm_weight=None):
                return fused_attnres(query, [*rows, partial], norm_weight, output_norm_weight, rms_eps=eps)

            # plain bank rows: ours stores grad-sink aliases meant for its own fused AttnRes backward
            ops.kda_chunk, ops.block_attnres, ops.attnres_bank_row = fla_kda, fla_attnres, lambda x: x
        elif name != "ours":
            raise ValueError(f"kernel set: unknown {name!r}")
        yield
    finally:
        for k, v in saved.items():
            setattr(ops, k, v)


def _dims():
    """ParallelDims for one device (everything 1): what parallelize_k3 reads."""
    return SimpleNamespace(tp=1, pp=1, cp=1, ep=1, fsdp_enabled=False, dp_replicate_enabled=False)


def build(cfg: K3Config, sc: StepConfig, device: torch.device):
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig

    from k3_torchtitan import K3TitanModel, parallelize_k3

    mcfg = K3TitanModel.Config(k3=cfg)
    with torch.device("meta"):
        model = mcfg.build()
    model = parallelize_k3(model, parallel_dims=_dims(), training=TrainingConfig(seq_len=sc.seq_len),
                           parallelism=ParallelismConfig(spmd_backend="partial_dtensor",
                                                         context_parallel_load_balancer=None),
                           compile_config=CompileConfig(), ac_config=None, dump_folder="")
    model.to_empty(device=device)
    torch.manual_seed(0)
    model.init_weights()
    model = model.to(getattr(torch, sc.dtype))
    _, flops_per_token = mcfg.get_nparams_and_flops(model, sc.seq_len)
    return model, flops_per_token


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(model, cfg: K3Config, sc: StepConfig, device: torch.device) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (sc.batch, sc.seq_len + 1), generator=g).to(device)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, foreach=True)
    times, losses = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(sc.warmup + sc.steps):
        _sync(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        opt.step()
        _sync(device)
        if i >= sc.warmup:
            times.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
    step = statistics.median(times)
    row = {"step_s_median": step, "step_s_all": times, "tokens_per_s": sc.batch * sc.seq_len / step,
           "loss_first": losses[0], "loss_last": losses[-1]}
    if device.type == "cuda":
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def run(sc: StepConfig, out: str | None = None, sets: tuple[str, ...] = ()) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() and not sc.smoke else "cpu")
    cfg = model_config(sc)
    sets = list(sets or (["ours", "reference"] if device.type == "cpu" else ["ours", "fla", "reference"]))
    result = {**run_header("train_step", device=str(device) if device.type == "cpu" else torch.cuda.get_device_name(),
                           packages=("torchtitan", "triton", "fla-core")),
              "settings": sc.__dict__, "model": {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
                                                 "experts": cfg.num_experts, "top_k": cfg.num_experts_per_token},
              "rows": {}}
    if device.type == "cpu":
        result["note"] = "CPU smoke run at tiny shapes: checks the script; ours = reference on CPU (same ops)"
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if device.type == "cuda" and k in torch.cuda.get_device_name()),
                None)
    for name in sets:
        with kernel_set(name):
            model, flops_per_token = build(cfg, sc, device)
            row = measure(model, cfg, sc, device)
        row["flops_per_token"] = flops_per_token
        if peak is not None:
            row["mfu"] = flops_per_token * row["tokens_per_s"] / peak
        result["rows"][name] = row
        print(name, {k: v for k, v in row.items() if k != "step_s_all"}, flush=True)
        write_results(out or "train_step", result)  # after every set: a cut-short run keeps what it measured
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"{'kernels':<10} {'tokens/s':>12} {'step s':>10} {'MFU':>7} {'peak GiB':>9}")
    for name, r in result["rows"].items():
        print(f"{name:<10} {r['tokens_per_s']:>12.1f} {r['step_s_median']:>10.4f} {r.get('mfu', float('nan')):>7.3f} "
              f"{r.get('peak_memory_gib', float('nan')):>9.2f}")
    path = write_results(out or "train_step", result)
    print(f"wrote {path}")
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny preset, short sequence (a check of the script)")
    p.add_argument("--layers", type=int)
    p.add_argument("--experts", type=int, default=StepConfig.experts)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--batch", type=int, default=StepConfig.batch)
    p.add_argument("--steps", type=int)
    p.add_argument("--warmup", type=int)
    p.add_argument("--out", help="result path (.json) or name under benchmarks/results/")
    p.add_argument("--sets", default="", help="kernel sets to run, comma-separated (default: ours,fla,reference)")
    a = p.parse_args(argv)
    smoke = dict(layers=4, seq_len=32, steps=2, warmup=1, dtype="float32") if a.smoke else {}
    given = {k: v for k, v in dict(layers=a.layers, seq_len=a.seq_len, steps=a.steps, warmup=a.warmup).items()
             if v is not None}
    sc = StepConfig(**{**smoke, **given, "experts": a.experts, "batch": a.batch, "smoke": a.smoke})
    return run(sc, a.out, tuple(x for x in a.sets.split(",") if x))


if __name__ == "__main__":
    main()
