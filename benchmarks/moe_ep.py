"""Expert-parallel MoE forward and forward+backward over W ranks: TorchTitan 0.3.0's EP path (its
AllToAllTokenDispatcher: reorder + all_to_all, GroupedExperts on torch._grouped_mm, all_to_all + combine) vs ours
(k3_kernels.moe_ep: micro-batched dispatch / moe kernels / combine on three streams), one process per GPU, both on
the same tokens, routing (one fused-router call, not timed) and expert weights, in the same run.

    python -m benchmarks.moe_ep --world 2                 # >= 2 GPUs (refuses otherwise); JSON: results/moe_ep.json
    python -m benchmarks.moe_ep --smoke                   # 2 gloo ranks on CPU, tiny shapes: runs every path once

Reported per token count (per rank): medians over reps of the slowest rank's time, fwd and fwd+bwd, and whether
each implementation's output and gradients are bitwise equal across two runs. TorchTitan's experts apply SiLU where
K3 has SiTU (an elementwise difference, same GEMMs and traffic). CPU (--smoke) times are not figures: only that
every path runs and the JSON is written (results/moe_ep_smoke.json)."""
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

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks._results import run_header, write_results  # noqa: E402


def _titan(E_local, L, I, E, k, mesh, device):
    from torchtitan.models.common.moe import GroupedExperts
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher
    from torchtitan.distributed.utils import set_spmd_backend

    set_spmd_backend("partial_dtensor")  # the plain process-group path (no spmd_types mesh context here)
    disp = AllToAllTokenDispatcher(AllToAllTokenDispatcher.Config(num_experts=E, top_k=k))
    disp.wire_meshes(ep_mesh=mesh)
    with torch.device(device):
        experts = GroupedExperts(GroupedExperts.Config(dim=L, hidden_dim=I, num_experts=E_local))
    return disp, experts


def _bits_equal(a, b) -> bool:
    return all(x.shape == y.shape and torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
               for x, y in zip(a, b))


def _rank(rank, world, args, out_path):
    from k3_kernels.moe_ep import EPConfig, ep_moe_experts

    cpu = args.smoke
    backend = "gloo" if cpu else "nccl"
    if not cpu:
        torch.cuda.set_device(rank)
    device = torch.device("cpu" if cpu else f"cuda:{rank}")
    dist.init_process_group(backend, init_method=f"file://{out_path}.store", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu" if cpu else "cuda", (world,), mesh_dim_names=("ep",))["ep"]
    group = mesh.get_group()
    L, I, E, k = args.latent, args.intermediate, args.experts, args.top_k
    dtype = torch.float32 if cpu else torch.bfloat16
    E_local = E // world
    g = torch.Generator(device="cpu").manual_seed(1234 + rank)
    w1, w3 = ((torch.randn(E_local, I, L, generator=g) / L ** 0.5).to(device, dtype) for _ in range(2))
    w2 = (torch.randn(E_local, L, I, generator=g) / I ** 0.5).to(device, dtype)
    rw = (torch.randn(E, L, generator=torch.Generator().manual_seed(7)) / L ** 0.5).to(device, dtype)
    disp, titan = _titan(E_local, L, I, E, k, mesh, device)
    with torch.no_grad():
        titan.w1_EFD.copy_(w1), titan.w3_EFD.copy_(w3), titan.w2_EDF.copy_(w2)
    titan = titan.to(dtype)
    ours_w = [t.clone().requires_grad_() for t in (w1, w3, w2)]
    cfg = EPConfig(micro_batches=args.micro_batches, ring_slots=2, check_across_ranks=False)
    rows = []
    for N in args.tokens:
        x = torch.randn(N, L, generator=g).to(device, dtype)
        dout = torch.randn(N, L, generator=g).to(device, dtype)
        with torch.no_grad():
            if cpu:
                from k3_kernels.moe.naive import naive_router
                ids, w = naive_router(x, rw, None, k)
            else:
                from k3_kernels.moe.router import fused_router
                ids, w = fused_router(x, rw, None, k)
        ids, w = ids.contiguous(), w.contiguous()
        counts = torch.bincount(ids.reshape(-1), minlength=E)

        def titan_fwd(xx, ww):
            routed, per_local, meta = disp.dispatch(xx, ww, ids, counts)
            return disp.combine(titan(routed, per_local), meta, xx)

        def ours_fwd(xx, ww):
            return ep_moe_experts(xx, ids, ww, *ours_w, E, group, cfg)

        impls = {"torchtitan": (titan_fwd, list(titan.parameters())), "ours": (ours_fwd, ours_w)}
        point = {"tokens_per_rank": N}
        for name, (fwd, params) in impls.items():
            def run_fwd():
                with torch.no_grad():
                    return [fwd(x, w)]

            def run_fwd_bwd():
                xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
                for p in params:
                    p.grad = None
                y = fwd(xx, ww)
                y.backward(dout)
                return [y.detach(), xx.grad, ww.grad] + [p.grad for p in params]

            res = {}
            for key, fn in (("fwd_ms", run_fwd), ("fwd_bwd_ms", run_fwd_bwd)):
                first = fn()
                bitwise = _bits_equal(first, fn())
                times = []
                for _ in range(args.warmup + args.reps):
                    dist.barrier(group)
                    if not cpu:
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    fn()
                    if not cpu:
                        torch.cuda.synchronize()
                    times.append((time.perf_counter() - t0) * 1e3)
                mine = torch.tensor(statistics.median(times[args.warmup:]), dtype=torch.float64)
                allt = [torch.zeros_like(mine) for _ in range(world)]
                dist.all_gather(allt, mine.to(device), group=group)
                res[key] = max(float(t) for t in allt)  # the slowest rank's median
                res[key.replace("_ms", "_bitwise_across_runs")] = bitwise
            point[name] = res
        tt, us = point["torchtitan"], point["ours"]
        us["speedup_fwd"] = tt["fwd_ms"] / us["fwd_ms"]
        us["speedup_fwd_bwd"] = tt["fwd_bwd_ms"] / us["fwd_bwd_ms"]
        rows.append(point)
        if rank == 0:
            print(f"N={N:6d}  torchtitan fwd {tt['fwd_ms']:8.3f} ms  fwd+bwd {tt['fwd_bwd_ms']:8.3f} ms | ours fwd "
                  f"{us['fwd_ms']:8.3f} ms ({us['speedup_fwd']:.2f}x) fwd+bwd {us['fwd_bwd_ms']:8.3f} ms "
                  f"({us['speedup_fwd_bwd']:.2f}x)  bitwise ours {us['fwd_bitwise_across_runs']}/"
                  f"{us['fwd_bwd_bitwise_across_runs']} titan {tt['fwd_bitwise_across_runs']}/"
                  f"{tt['fwd_bwd_bitwise_across_runs']}", flush=True)
    if rank == 0:
        torch.save(rows, out_path)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="2 gloo ranks on CPU, tiny shapes (no figures)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192, 16384, 32768])
    ap.add_argument("--latent", type=int, default=3584)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--experts", type=int, default=128, help="in total (E / world per rank)")
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.world, args.tokens, args.latent, args.intermediate = 2, [64, 96], 128, 128
        args.experts, args.top_k, args.warmup, args.reps, args.micro_batches = 8, 2, 0, 2, 2
    elif torch.cuda.device_count() < max(2, args.world):
        raise SystemExit(f"benchmarks.moe_ep needs >= {max(2, args.world)} GPUs, this machine has "
                         f"{torch.cuda.device_count()} (use --smoke for the CPU check)")
    if args.experts % args.world:
        raise SystemExit(f"--experts {args.experts} is not divisible by --world {args.world}")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "rows.pt")
        mp.start_processes(_rank, args=(args.world, args, path), nprocs=args.world, join=True,
                           start_method="spawn")
        rows = torch.load(path, weights_only=False)
    name = "moe_ep_smoke" if args.smoke else "moe_ep"
    result = {**run_header(name, device="cpu" if args.smoke else torch.cuda.get_device_name(0),
                           packages=("triton", "torchtitan")),
              "world": args.world, "shape": {"latent": args.latent, "intermediate": args.intermediate,
                                             "experts": args.experts, "top_k": args.top_k,
                                             "micro_batches": args.micro_batches},
              "transport": "gloo all_to_all_single" if args.smoke else "NCCL all_to_all_single (both)",
              "timing": "median over reps of the slowest rank, host clock around synchronised calls",
              "smoke": args.smoke, "points": rows}
    print("wrote", write_results(args.out or name, result))


if __name__ == "__main__":
    main()
