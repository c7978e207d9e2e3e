"""Rank processes for the all-reduce tests (tests/kernels/test_comm*.py): each rank runs a fixed battery of
`k3_kernels.comm.all_reduce` calls over a pair group (ranks 0, 1) and the whole world, and saves what it got (and
the errors it caught) for the parent process to compare with the spec. Inputs come from `make_input`, which the
parent calls too, so nothing is exchanged except through the library under test."""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
from _spawned_ranks import error_text

SHAPES = ((1,), (7,), (1001,), (5, 13), (0,))
DTYPES = (torch.float32, torch.bfloat16)
GROUPS = {"solo": (0,), "pair": (0, 1), "world": None}  # None: every rank of the world


def make_input(rank: int, shape: tuple, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Rank `rank`'s deterministic input: normal draws over ~8 decades, so that the order of the sum shows in the
    bits (reordering 3 such terms changes some element's rounding)."""
    g = torch.Generator().manual_seed(zlib.crc32(repr((rank, shape, str(dtype), salt)).encode()))
    n = 1
    for d in shape:
        n *= d
    x = torch.randn(n, generator=g, dtype=torch.float64)
    x = x * torch.pow(10.0, torch.randint(-4, 4, (n,), generator=g).double())
    return x.to(dtype).reshape(shape)


def algorithms():
    from k3_kernels.comm import Algorithm

    return {"auto": None, "one_shot": Algorithm.ONE_SHOT, "two_shot": Algorithm.TWO_SHOT}


def run_battery(rank: int, world: int, store_dir: str, device: str = "cpu", backend: str = "gloo") -> dict:
    from k3_kernels.comm import AllReduceConfig, all_reduce

    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"file://{store_dir}/store", rank=rank, world_size=world)
    if device == "cuda":
        torch.cuda.set_device(rank)
    groups = {name: dist.new_group(list(ranks)) if ranks else dist.group.WORLD for name, ranks in GROUPS.items()}
    members = {name: ranks or tuple(range(world)) for name, ranks in GROUPS.items()}
    out: dict = {"results": {}, "repeat_equal": {}, "errors": {}}
    for gname, group in groups.items():
        if rank not in members[gname]:
            continue
        for dtype in DTYPES:
            for shape in SHAPES:
                for aname, algo in algorithms().items():
                    x = make_input(rank, shape, dtype).to(device)
                    before = x.clone()
                    config = AllReduceConfig(algorithm=algo)
                    first = all_reduce(x, group, config)
                    second = all_reduce(x, group, config)
                    key = (gname, str(dtype), shape, aname)
                    out["results"][key] = first.cpu()
                    out["repeat_equal"][key] = (torch.equal(first.view(torch.uint8), second.view(torch.uint8))
                                                and torch.equal(x, before))
    if device == "cpu":
        out["errors"] = _bad_inputs(rank, groups["world"], all_reduce, AllReduceConfig)
    dist.barrier()
    dist.destroy_process_group()
    return out


def _bad_inputs(rank: int, group, all_reduce, AllReduceConfig) -> dict:
    """Bad calls on the world group (3 ranks), then a good one: every rank must raise the same error for a bad
    tensor on any one rank, and the group must still work after."""
    f32 = torch.float32
    shape_mismatch = make_input(rank, (8,) if rank == 1 else (7,), f32)
    dtype_mismatch = make_input(rank, (7,), torch.bfloat16 if rank == 2 else f32)
    base = make_input(rank, (4, 6), f32)
    non_contiguous = base.t().contiguous().t() if rank == 0 else base  # rank 0: a (4, 6) view with stride (1, 4)
    errors = {
        "shape": error_text(lambda: all_reduce(shape_mismatch, group, name="grad")),
        "dtype": error_text(lambda: all_reduce(dtype_mismatch, group, name="grad")),
        "non_contiguous": error_text(lambda: all_reduce(non_contiguous, group, name="grad")),
        "int_dtype": error_text(lambda: all_reduce(torch.arange(5, dtype=torch.int32), group, name="grad")),
        "not_tensor": error_text(lambda: all_reduce([1.0, 2.0], group, name="grad")),
        "local_only": error_text(lambda: all_reduce(base.t(), group, AllReduceConfig(check_across_ranks=False),
                                                name="grad")),
    }
    after = all_reduce(make_input(rank, (7,), f32, salt=1), group)
    return {**errors, "after": after}


GPU_NUMELS = (1, 7, 1001, 4096, (1 << 16) + 3, 1 << 20, (3 << 21) + 5)  # up to 25 MB in fp32: regrows the buffer


def run_gpu_battery(rank: int, world: int, store_dir: str) -> dict:
    """On CUDA over NCCL + symmetric memory: every size, dtype, algorithm and sync mode, three calls back to back
    with different inputs (the double-buffered slots reused without a host sync), each compared here with the
    spec computed from every rank's inputs (make_input is deterministic), plus the process-group path."""
    from k3_kernels.comm import AllReduceConfig, Sync, all_reduce, naive_all_reduce

    torch.set_num_threads(1)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store_dir}/store", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    ok: dict = {}
    for numel in GPU_NUMELS:
        for dtype in DTYPES:
            specs = [naive_all_reduce([make_input(r, (numel,), dtype, salt=s) for r in range(world)]) for s in range(3)]
            for aname, algo in algorithms().items():
                for sync in (Sync.IN_KERNEL, Sync.HOST_BARRIER, None):
                    config = (AllReduceConfig(algorithm=algo, sync=sync, check_across_ranks=False) if sync else
                              AllReduceConfig(algorithm=algo, use_symmetric_memory=False))
                    xs = [make_input(rank, (numel,), dtype, salt=s).cuda() for s in range(3)]
                    outs = [all_reduce(x, None, config) for x in xs]  # no sync between the calls
                    torch.cuda.synchronize()
                    key = (numel, str(dtype), aname, sync.value if sync else "process_group")
                    ok[key] = all(torch.equal(o.cpu().view(torch.uint8), s.view(torch.uint8))
                                  for o, s in zip(outs, specs))
    dist.barrier()
    dist.destroy_process_group()
    return {"ok": ok}


def ptx_summary() -> dict:
    """Compile peer_sum's kernels for sm_90 (the H200) without a GPU and count the instructions the tests care
    about. Run in a process without TRITON_INTERPRET (the interpreter replaces @triton.jit at import)."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from k3_kernels.comm import peer_sum

    out = {}
    for ty in ("fp32", "bf16"):
        for name, fn, extra in (("one_shot", peer_sum._one_shot_kernel, {}),
                                ("two_shot", peer_sum._two_shot_kernel, {"GATHER": True})):
            sig = {"x_ptr": f"*{ty}", "buf_ptr": f"*{ty}", "deltas": "*i64", "pads": "*i64", "in_offset": "i32"}
            if name == "two_shot":
                sig["shard_offset"] = "i32"
            sig.update({"out_ptr": f"*{ty}", "n": "i32"})
            if name == "two_shot":
                sig["shard"] = "i32"
            sig["rank"] = "i32"
            consts = {"W": 3, "WP": 4, "BLOCK": peer_sum.BLOCK, "COPY_IN": True, "REDUCE": True, "SYNC": True, **extra}
            sig.update({k: "constexpr" for k in consts})
            names = list(sig)
            # what Triton's specialisation sees for a message whose sizes and offsets are multiples of 16
            attrs = {(names.index(k),): [["tt.divisibility", 16]] for k, v in sig.items()
                     if v != "constexpr" and k != "rank"}
            ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                                 target=GPUTarget("cuda", 90, 32), options={"num_warps": peer_sum.NUM_WARPS}).asm["ptx"]
            ops = re.findall(r"\b(ld\.global[.\w]*|st\.global[.\w]*|atom[.\w]*|multimem[.\w]*|red\.[.\w]*)", ptx)
            out[f"{name}_{ty}"] = {op: ops.count(op) for op in sorted(set(ops))}
    return out
