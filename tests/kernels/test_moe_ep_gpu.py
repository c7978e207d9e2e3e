"""The expert-parallel MoE pipeline on >= 2 GPUs (NCCL, the moe Triton kernels, three streams): every rank's output,
token and gate gradients equal, bit for bit, the single-device moe layer (k3_kernels.moe.moe_experts over all
experts on all ranks' tokens) with 1 and 4 micro-batches (the grouped GEMMs use one tile configuration for every
row count, so a row's bits do not depend on its micro-batch); expert weight gradients within bf16 rounding with 4
(a sum over micro-batches); the FP8 dispatch equals the single-device FP8 layer; a second run the same bits.
CPU counterpart: test_moe_ep.py (gloo, the spec path). Skipped with fewer than 2 GPUs."""
from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.gpu
WORLD = 2
E, K, L, I, N = 16, 4, 256, 256, 384


def _worker(rank: int, store: str) -> None:
    import torch.distributed as dist

    from k3_kernels.moe import Precision, fused_router, moe_experts
    from k3_kernels.moe_ep import EPConfig, ep_moe_experts

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}/store", rank=rank, world_size=WORLD)
    dev = torch.device("cuda", rank)
    g = torch.Generator().manual_seed(5)
    rw = (torch.randn(E, L, generator=g) / L ** 0.5).to(dev, torch.bfloat16)
    w1, w3 = ((torch.randn(E, I, L, generator=g) / L ** 0.5).to(dev, torch.bfloat16) for _ in range(2))
    w2 = (torch.randn(E, L, I, generator=g) / I ** 0.5).to(dev, torch.bfloat16)
    xs = [torch.randn(N + 64 * r, L, generator=g).to(dev, torch.bfloat16) for r in range(WORLD)]
    gs = [torch.randn(N + 64 * r, L, generator=g).to(dev, torch.bfloat16) for r in range(WORLD)]
    x_all, g_all = torch.cat(xs), torch.cat(gs)
    ids_all, w_all = fused_router(x_all, rw, None, K)
    lo = sum(x.shape[0] for x in xs[:rank])
    sl = slice(lo, lo + xs[rank].shape[0])
    per = E // WORLD
    mine = [t[rank * per:(rank + 1) * per].contiguous() for t in (w1, w3, w2)]
    # the single-device layer
    xr, wr = x_all.clone().requires_grad_(), w_all.clone().requires_grad_()
    full = [t.clone().requires_grad_() for t in (w1, w3, w2)]
    y = moe_experts(xr, ids_all, wr, *full)
    y.backward(g_all)
    fails = []
    for m in (1, 4, 4):
        xl, wl = xs[rank].clone().requires_grad_(), w_all[sl].clone().requires_grad_()
        ws = [t.clone().requires_grad_() for t in mine]
        yl = ep_moe_experts(xl, ids_all[sl], wl, *ws, E, None, EPConfig(micro_batches=m))
        yl.backward(gs[rank])
        for name, a, b in (("y", yl, y[sl]), ("dx", xl.grad, xr.grad[sl]), ("dw", wl.grad, wr.grad[sl])):
            if not torch.equal(a, b):
                fails.append(f"m={m} {name}: max diff {(a.float() - b.float()).abs().max().item()}")
        for name, a, b in zip(("dw1", "dw3", "dw2"), [t.grad for t in ws], [t.grad for t in full]):
            b = b[rank * per:(rank + 1) * per]
            if (m == 1 and not torch.equal(a, b)) or not torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2):
                fails.append(f"m={m} {name}: max diff {(a.float() - b.float()).abs().max().item()}")
    with torch.no_grad():
        y8 = moe_experts(x_all, ids_all, w_all, w1, w3, w2, precision=Precision.FP8)
        y8l = ep_moe_experts(xs[rank], ids_all[sl], w_all[sl], *mine, E, None, EPConfig(micro_batches=2, fp8=True))
    if not torch.equal(y8l, y8[sl]):
        fails.append(f"fp8: max diff {(y8l.float() - y8[sl].float()).abs().max().item()}")
    with open(os.path.join(store, f"rank{rank}.txt"), "w") as f:
        f.write("\n".join(fails))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason="needs >= 2 GPUs (NCCL all_to_all between them)")
def test_ep_on_gpus_matches_the_single_device_layer(tmp_path):
    mp.start_processes(_worker, args=(str(tmp_path),), nprocs=WORLD, join=True, start_method="spawn")
    fails = [(r, (tmp_path / f"rank{r}.txt").read_text()) for r in range(WORLD)]
    assert all(not f for _, f in fails), fails
