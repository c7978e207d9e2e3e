"""All-reduce latency on 2+ GPUs of one host: NCCL (`dist.all_reduce`), torch's symmetric-memory one-shot and
two-shot (`torch.ops.symm_mem.one_shot_all_reduce`, `two_shot_all_reduce_`) and ours (`k3_kernels.comm.all_reduce`:
the automatic choice, one-shot and two-shot forced, in-kernel meetings; the automatic choice with torch's host
barrier, with the cross-rank input check, and over NCCL's all-gather instead of symmetric memory, to show their
price), bf16 at 8 KB .. 32 MB, all in one process per rank. Times: medians of CUDA-event timings of single calls after warm-up (the anchors' method,
shared/anchors/bench_comm.py), so host overhead counts where the host is slower than the GPU.
Determinism: ours compared bit for bit, twice, with the spec (every rank's input gathered, summed in rank order in
fp32, rounded once) on every rank; NCCL's and torch two-shot's results are compared with the spec too (informative:
their order is not fixed). The in-place baselines (NCCL, torch two-shot) run on zeros so that repeated sums stay
finite; ours runs out of place on random inputs (times do not depend on the values).

    python -m benchmarks.allreduce [--world N] [--iters 200]   # spawns N ranks (default: every GPU, >= 2)
    python -m benchmarks.allreduce --smoke                     # 2 gloo ranks on CPU, tiny sizes: checks the script

Writes benchmarks/results/allreduce.json ($OUT/allreduce.json when OUT is set; --smoke: allreduce_smoke.json in a
temporary folder or $OUT)."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks._results import run_header, write_results
from k3_kernels.comm import Algorithm, AllReduceConfig, Sync, all_reduce, ordered_sum
from k3_kernels.comm.process_group import all_gather_rows

SIZES = (8 << 10, 64 << 10, 512 << 10, 1 << 20, 4 << 20, 32 << 20)
SMOKE_SIZES = (8 << 10, 64 << 10)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _time_gpu(fn, iters: int, warm: int) -> float:
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1000)
    return statistics.median(ts)


def _time_cpu(fn, iters: int, warm: int) -> float:
    for _ in range(warm):
        fn()
    dist.barrier()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts)


def _ours(**kw) -> AllReduceConfig:
    return AllReduceConfig(check_across_ranks=kw.pop("check_across_ranks", False), **kw)


OURS = {"ours": _ours(), "ours_one_shot": _ours(algorithm=Algorithm.ONE_SHOT),
        "ours_two_shot": _ours(algorithm=Algorithm.TWO_SHOT), "ours_host_barrier": _ours(sync=Sync.HOST_BARRIER),
        "ours_checked": _ours(check_across_ranks=True), "ours_process_group": _ours(use_symmetric_memory=False)}


def _spec(x: torch.Tensor) -> torch.Tensor:
    """naive.py's sum of every rank's x (gathered with the process group, summed here)."""
    return ordered_sum(all_gather_rows(x, dist.group.WORLD).unbind(0), x.dtype)


def _row(nbytes: int, rank: int, world: int, dev: torch.device, smoke: bool, iters: int, warm: int) -> dict:
    dtype = torch.bfloat16
    n = nbytes // dtype.itemsize
    g = torch.Generator(device="cpu").manual_seed(1000 * rank + nbytes % 997)
    x = torch.randn(n, generator=g).to(dtype).to(dev)
    spec = _spec(x)
    timer = _time_cpu if smoke else _time_gpu
    row: dict = {"bytes": nbytes, "us": {}, "bitwise_equal_spec": {}}
    zeros = torch.zeros_like(x)
    row["us"]["nccl" if not smoke else "gloo"] = timer(lambda: dist.all_reduce(zeros), iters, warm)
    y = x.clone()
    dist.all_reduce(y)
    row["bitwise_equal_spec"]["nccl" if not smoke else "gloo"] = _bits_equal(y, spec)
    if not smoke:
        import torch.distributed._symmetric_memory as symm

        gname = dist.group.WORLD.group_name
        t = symm.empty(n, dtype=dtype, device=dev)
        t.zero_()
        symm.rendezvous(t, gname)
        row["us"]["torch_one_shot"] = timer(lambda: torch.ops.symm_mem.one_shot_all_reduce(t, "sum", gname),
                                            iters, warm)
        row["us"]["torch_two_shot"] = timer(lambda: torch.ops.symm_mem.two_shot_all_reduce_(t, "sum", gname),
                                            iters, warm)
        t.copy_(x)
        torch.ops.symm_mem.two_shot_all_reduce_(t, "sum", gname)
        row["bitwise_equal_spec"]["torch_two_shot"] = _bits_equal(t, spec)
    for name, config in OURS.items():
        if smoke and (config.sync is Sync.HOST_BARRIER or not config.use_symmetric_memory):
            continue  # on CPU every `ours` row is the process-group path already
        row["us"][name] = timer(lambda: all_reduce(x, None, config), iters, warm)
        row["bitwise_equal_spec"][name] = all(_bits_equal(all_reduce(x, None, config), spec) for _ in range(2))
    ok = torch.tensor([all(v for k, v in row["bitwise_equal_spec"].items() if k.startswith("ours"))], device=dev,
                      dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    row["ours_bitwise_equal_spec_every_rank"] = bool(ok.item())
    base = "gloo" if smoke else "nccl"
    row["speedup_vs_" + base] = row["us"][base] / row["us"]["ours"]
    if not smoke:
        row["speedup_vs_torch_two_shot"] = row["us"]["torch_two_shot"] / row["us"]["ours"]
    return row


def _rank_main(rank: int, world: int, store_dir: str, args) -> None:
    smoke = args.smoke
    if not smoke:
        torch.cuda.set_device(rank)
    dev = torch.device("cpu") if smoke else torch.device("cuda", rank)
    kw = {} if smoke else {"device_id": dev}
    dist.init_process_group("gloo" if smoke else "nccl", init_method=f"file://{store_dir}/store", rank=rank,
                            world_size=world, **kw)
    torch.set_num_threads(1)
    rows = []
    for nbytes in SMOKE_SIZES if smoke else SIZES:
        row = _row(nbytes, rank, world, dev, smoke, args.iters, args.warm)
        rows.append(row)
        if rank == 0:
            us = "  ".join(f"{k} {v:8.1f}" for k, v in row["us"].items())
            print(f"{nbytes >> 10:>6} KB  {us}  bitwise={row['ours_bitwise_equal_spec_every_rank']}", flush=True)
    if rank == 0:
        result = {**run_header("allreduce", device="cpu (gloo, smoke)" if smoke else torch.cuda.get_device_name(),
                               packages=("triton",)),
                  "world": world, "dtype": "bfloat16", "iters": args.iters, "warm": args.warm,
                  "configs": {k: repr(v) for k, v in OURS.items()}, "rows": rows}
        if not smoke:
            result["one_shot_faster_up_to_bytes"] = max(
                [r["bytes"] for r in rows if r["us"]["ours_one_shot"] <= r["us"]["ours_two_shot"]], default=0)
        print("wrote", write_results(args.out, result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="2 gloo ranks on CPU, tiny sizes: checks the script")
    ap.add_argument("--world", type=int, default=None, help="ranks (default: every GPU; smoke: 2)")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--warm", type=int, default=None)
    ap.add_argument("--out", default=None, help="results path (.json) or name under benchmarks/results/")
    args = ap.parse_args(argv)
    if args.smoke:
        world = args.world or 2
        args.iters, args.warm = args.iters or 5, args.warm or 2
        out_dir = os.environ.get("OUT") or tempfile.mkdtemp(prefix="allreduce_smoke_")
        args.out = args.out or os.path.join(out_dir, "allreduce_smoke.json")
    else:
        gpus = torch.cuda.device_count()
        if gpus < 2:
            sys.exit(f"benchmarks/allreduce.py needs >= 2 CUDA GPUs on one host (found {gpus}); "
                     f"`--smoke` checks the script on CPU")
        world = args.world or gpus
        if not 2 <= world <= gpus:
            sys.exit(f"--world {world}: between 2 and the {gpus} GPUs here")
        args.iters, args.warm = args.iters or 200, args.warm or 20
        args.out = args.out or (os.path.join(os.environ["OUT"], "allreduce.json") if os.environ.get("OUT")
                                else "allreduce")
    with tempfile.TemporaryDirectory(prefix="allreduce_store_") as store_dir:
        mp.start_processes(_rank_main, args=(world, store_dir, args), nprocs=world, join=True, start_method="spawn")


if __name__ == "__main__":
    main()
