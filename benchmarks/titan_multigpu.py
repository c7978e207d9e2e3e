"""K3 through the TorchTitan plugin on several devices: each parallel setting against a 1-rank reference run from
the same seed weights and the same global batch, and its throughput and memory.

    torchrun --nproc-per-node 2 -m benchmarks.titan_multigpu --settings fsdp2,ep2,cp2,cp2ep2       # GPUs
    torchrun --nproc-per-node 2 -m benchmarks.titan_multigpu --device cpu --flavor k3_tiny ...     # CPU, gloo

TorchTitan's trainer does not import under the GPU machine's torch 2.11, so this script does what the trainer does
with the plugin, through the same public pieces: `ParallelDims` (TorchTitan's mesh builder) from the setting's
degrees and the world size, the ModelSpec's model built on meta, its parallelize_fn (`parallelize_k3`), `to_empty`,
then the seed state dict loaded with torch.distributed.checkpoint's `set_model_state_dict` (full state dict onto the
sharded parameters). A step is forward + summed cross-entropy / global token count (the trainer's normalisation)
+ backward + TorchTitan's `clip_grad_norm_` (max_norm 1, EP-aware) + AdamW. Data-parallel ranks take their slice
of the global batch, context-parallel ranks their contiguous slice of the sequence (the plugin's CP needs
contiguous shards). The reference (rank 0, one device, no parallelize) runs the whole global batch.

Settings are degree tokens: fsdp<N> (data-parallel shard degree, default: world / cp), ep<N>, cp<N>, e.g. `cp2ep2`.
Reported per setting: both runs' losses and grad norms, max |d loss|, max |d grad norm|, tokens/s (global tokens /
median step time after the warm-up steps) and peak memory per device (each rank's and the max). Rank 0 writes the JSON.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from benchmarks._results import run_header, write_results


@dataclass(frozen=True)
class Setting:
    name: str
    dp_shard: int   # -1: world / cp (TorchTitan's inferred degree)
    ep: int = 1
    cp: int = 1


_TOKEN = re.compile(r"(fsdp|ep|cp)(\d+)")


def parse_setting(name: str) -> Setting:
    """'cp2ep2' -> Setting(cp=2, ep=2, dp_shard=-1); unknown text is an error naming the setting."""
    tokens = _TOKEN.findall(name)
    if not name or "".join(f"{k}{v}" for k, v in tokens) != name:
        raise ValueError(f"--settings: {name!r} is not a run of fsdp<N> / ep<N> / cp<N> tokens (e.g. cp2ep2)")
    degrees = {k: int(v) for k, v in tokens}
    if len(degrees) != len(tokens) or min(degrees.values()) < 1:
        raise ValueError(f"--settings: {name!r} repeats a token or has a degree < 1")
    return Setting(name, dp_shard=degrees.get("fsdp", -1), ep=degrees.get("ep", 1), cp=degrees.get("cp", 1))


def check_setting(s: Setting, *, world: int, seq_len: int, num_experts: int) -> None:
    """What the setting needs of the world size and the model, checked for every setting before any run starts."""
    dp = s.dp_shard if s.dp_shard > 0 else world // s.cp
    if dp < 1 or dp * s.cp != world:
        raise ValueError(f"--settings: {s.name!r} needs data-parallel shard {dp} x cp {s.cp} = the world size "
                         f"({world} ranks from torchrun)")
    if (dp * s.cp) % s.ep:
        raise ValueError(f"--settings: {s.name!r}: ep {s.ep} must divide fsdp x cp = {dp * s.cp} (TorchTitan "
                         "takes the expert-parallel ranks from them)")
    if num_experts % s.ep:
        raise ValueError(f"--settings: {s.name!r}: ep {s.ep} does not divide the model's {num_experts} experts")
    if seq_len % (2 * s.cp):
        raise ValueError(f"--seq-len: {seq_len} is not divisible by 2 x cp ({2 * s.cp}) of setting {s.name!r}")


@dataclass(frozen=True)
class RunConfig:
    flavor: str = "k3_small"
    seq_len: int = 2048
    local_batch: int = 2      # sequences per data-parallel rank
    steps: int = 5
    warmup: int = 1           # leading steps left out of the timing (all steps are compared)
    lr: float = 1e-3
    dtype: str = "float32"
    device: str = "cuda"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _training_config(rc: RunConfig):
    from torchtitan.config import TrainingConfig

    return TrainingConfig(seq_len=rc.seq_len, mixed_precision_param=rc.dtype, mixed_precision_reduce="float32")


def _parallelism(setting: Setting | None):
    from torchtitan.config import ParallelismConfig

    if setting is None:
        return ParallelismConfig(spmd_backend="partial_dtensor", context_parallel_load_balancer=None)
    return ParallelismConfig(spmd_backend="partial_dtensor", context_parallel_load_balancer=None,
                             data_parallel_shard_degree=setting.dp_shard, expert_parallel_degree=setting.ep,
                             context_parallel_degree=setting.cp)


def _build(rc: RunConfig, parallel_dims, parallelism, device: torch.device):
    """The trainer's order: ModelSpec model on meta -> parallelize_fn -> to_empty (weights loaded by the caller)."""
    from torchtitan.config import CompileConfig

    from k3_torchtitan import model_registry

    spec = model_registry(rc.flavor)
    with torch.device("meta"):
        model = spec.model.build()
    model = spec.parallelize_fn(model, parallel_dims=parallel_dims, training=_training_config(rc),
                                parallelism=parallelism, compile_config=CompileConfig(), ac_config=None,
                                dump_folder="")
    model.to_empty(device=device)
    return model


def seed_state_dict(rc: RunConfig) -> dict[str, torch.Tensor]:
    """The model's initialisation (init_weights, seed 0) on one CPU process: the same bits on every rank."""
    from types import SimpleNamespace

    one = SimpleNamespace(tp=1, pp=1, cp=1, ep=1, fsdp_enabled=False, dp_replicate_enabled=False)
    model = _build(rc, one, _parallelism(None), torch.device("cpu"))
    torch.manual_seed(0)
    model.init_weights()
    return {k: v.to(getattr(torch, rc.dtype)) for k, v in model.state_dict().items()}


def global_batch(rc: RunConfig, sequences: int, step: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (sequences, rc.seq_len + 1), generator=g)


def _steps(model, rc: RunConfig, device, batches, slicer, grad_norm_fn, loss_sum_fn) -> dict:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=rc.lr, foreach=True)
    losses, norms, times = [], [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i, ids in enumerate(batches):
        ids = ids.to(device)
        global_tokens = ids[:, 1:].numel()
        inputs, labels = slicer(ids[:, :-1]), slicer(ids[:, 1:])
        _sync(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                                 reduction="sum") / global_tokens
        loss.backward()
        norm = grad_norm_fn([p for p in model.parameters() if p.requires_grad])
        opt.step()
        _sync(device)
        if i >= rc.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss_sum_fn(loss.detach())))
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
    tokens = batches[0][:, 1:].numel()
    row = {"losses": losses, "grad_norms": norms, "step_s_median": statistics.median(times) if times else None,
           "tokens_per_s": tokens / statistics.median(times) if times else None}
    row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return row


def reference_run(rc: RunConfig, seed: dict, batches, device) -> dict:
    """One device, no parallelism: the whole global batch."""
    from types import SimpleNamespace

    one = SimpleNamespace(tp=1, pp=1, cp=1, ep=1, fsdp_enabled=False, dp_replicate_enabled=False)
    model = _build(rc, one, _parallelism(None), device)
    model.load_state_dict(seed)
    row = _steps(model, rc, device, batches, lambda x: x,
                 lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.0, foreach=True), lambda x: x)
    del model
    return row


def parallel_run(rc: RunConfig, setting: Setting, seed: dict, batches, device) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    world = dist.get_world_size()
    parallelism = _parallelism(setting)
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    dims = ParallelDims.from_config(parallelism, world)
    model = _build(rc, dims, parallelism, device)
    # a copy: set_model_state_dict replaces the dict's values by the distributed tensors
    set_model_state_dict(model, dict(seed), options=StateDictOptions(full_state_dict=True, strict=True))
    dp_size = dims.dp_replicate * dims.dp_shard
    dp_rank = dims.get_mesh("batch").get_local_rank() if dp_size > 1 else 0
    cp_rank = dims.get_mesh("cp").get_local_rank() if dims.cp > 1 else 0
    shard = rc.seq_len // dims.cp

    def slicer(x: torch.Tensor) -> torch.Tensor:
        x = x[dp_rank * rc.local_batch:(dp_rank + 1) * rc.local_batch]
        return x[:, cp_rank * shard:(cp_rank + 1) * shard].contiguous()

    def loss_sum(x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x)   # every rank holds distinct tokens (TP = PP = 1): the world is the loss mesh
        return x

    def grad_norm(ps):
        return dist_utils.clip_grad_norm_(ps, 1.0, foreach=True, pp_mesh=None, ep_enabled=dims.ep_enabled)

    row = _steps(model, rc, device, batches, slicer, grad_norm, loss_sum)
    peaks = [torch.zeros(1, device=device) for _ in range(world)]
    dist.all_gather(peaks, torch.tensor([row["peak_memory_gib"] or 0.0], device=device))
    if device.type == "cuda":
        row["peak_memory_gib_per_rank"] = [float(x) for x in peaks]
        row["peak_memory_gib"] = max(row["peak_memory_gib_per_rank"])
    row["dims"] = {"dp_shard": dims.dp_shard, "ep": dims.ep, "cp": dims.cp, "world": world}
    del model
    return row


def run(rc: RunConfig, settings: list[Setting], out: str | None) -> dict | None:
    device = torch.device(rc.device)
    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        from k3_torchtitan.cpu import use_cpu

        use_cpu()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from k3_torchtitan import model_config

    k3 = model_config(rc.flavor).k3
    for s in settings:
        check_setting(s, world=world, seq_len=rc.seq_len, num_experts=k3.num_experts)
    seed = seed_state_dict(rc)
    vocab = k3.vocab_size
    result = {**run_header("titan_multigpu", device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                           packages=("torchtitan", "triton")),
              "settings": asdict(rc), "world": world, "rows": {}}
    for s in settings:
        cp = s.cp
        dp = s.dp_shard if s.dp_shard > 0 else world // cp
        batches = [global_batch(rc, dp * rc.local_batch, i, vocab) for i in range(rc.steps)]
        ref = reference_run(rc, seed, batches, device) if rank == 0 else None
        dist.barrier()
        par = parallel_run(rc, s, seed, batches, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if rank == 0:
            row = {"setting": asdict(s), "dims": par.pop("dims"), "reference": ref, "parallel": par,
                   "max_abs_loss_diff": max(abs(a - b) for a, b in zip(ref["losses"], par["losses"])),
                   "max_abs_grad_norm_diff": max(abs(a - b) for a, b in zip(ref["grad_norms"], par["grad_norms"]))}
            result["rows"][s.name] = row
            print(s.name, {k: row[k] for k in ("dims", "max_abs_loss_diff", "max_abs_grad_norm_diff")},
                  "tokens/s", par["tokens_per_s"], "ref tokens/s", ref["tokens_per_s"],
                  "peak GiB", par["peak_memory_gib"], flush=True)
            write_results(out or "titan_multigpu", result)   # after every setting: a cut-short run keeps the rest
        dist.barrier()
    dist.destroy_process_group()
    return result if rank == 0 else None


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default="fsdp2,ep2,cp2,cp2ep2")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--flavor", default=RunConfig.flavor)
    p.add_argument("--seq-len", type=int, default=RunConfig.seq_len)
    p.add_argument("--local-batch", type=int, default=RunConfig.local_batch)
    p.add_argument("--steps", type=int, default=RunConfig.steps)
    p.add_argument("--warmup", type=int, default=RunConfig.warmup)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=RunConfig.dtype)
    p.add_argument("--out", help="result path (.json) or name under benchmarks/results/")
    a = p.parse_args(argv)
    settings = [parse_setting(x) for x in a.settings.split(",") if x]
    if not settings:
        p.error("--settings: name at least one setting")
    if a.steps <= a.warmup:
        p.error(f"--steps: {a.steps} must exceed --warmup {a.warmup} (timed steps)")
    rc = RunConfig(flavor=a.flavor, seq_len=a.seq_len, local_batch=a.local_batch, steps=a.steps, warmup=a.warmup,
                   dtype=a.dtype, device=a.device)
    return run(rc, settings, a.out)


if __name__ == "__main__":
    main()
