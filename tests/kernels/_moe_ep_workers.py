"""Rank processes for tests/kernels/test_moe_ep.py: every rank of one 4-rank gloo world builds the same full
expert weights (a fixed seed), keeps its shard, makes its own tokens (seeded by rank; token counts differ by rank),
runs the EP layer in a fixed battery of cases over the world (4 ranks) and a pair group (ranks 0, 1), and saves
what it got for the parent to compare with the single-device spec. Nothing is exchanged except through the code
under test."""
from __future__ import annotations

import _moe_interp  # noqa: F401  (the FP8 conversions in the interpreter, in the parent and in every rank alike)
import torch
import torch.distributed as dist
from _spawned_ranks import error_text

E, K, L, I = 8, 3, 32, 48        # fp32 / bf16 cases
L8, I8 = 128, 128                # the FP8 case (1 x 128 / 128 x 128 blocks)
GROUPS = {"pair": (0, 1), "world": (0, 1, 2, 3)}


def tokens(rank: int) -> int:
    """12, 18, 24, 30: uneven across ranks, 3 micro-batches of an even size each."""
    return 12 + 6 * rank


def params(width: int = L, inter: int = I, dtype=torch.float32, n_experts: int = E):
    g = torch.Generator().manual_seed(1234)
    rw = torch.randn(n_experts, width, generator=g) / width ** 0.5
    rb = torch.randn(n_experts, generator=g) * 0.1
    w1 = torch.randn(n_experts, inter, width, generator=g) / width ** 0.5
    w3 = torch.randn(n_experts, inter, width, generator=g) / width ** 0.5
    w2 = torch.randn(n_experts, width, inter, generator=g) / inter ** 0.5
    return tuple(t.to(dtype) for t in (rw, rb, w1, w3, w2))


def inputs(rank: int, width: int = L, dtype=torch.float32, salt: int = 0):
    """Rank `rank`'s tokens and the upstream gradient of its output."""
    g = torch.Generator().manual_seed(100 * rank + salt + 7)
    return (torch.randn(tokens(rank), width, generator=g).to(dtype),
            torch.randn(tokens(rank), width, generator=g).to(dtype))


def forced_ids(rank: int) -> torch.Tensor:
    """Router Replay: every other token forced to a fixed id pattern, the rest (-1) route freely."""
    f = torch.full((tokens(rank), K), -1, dtype=torch.long)
    for t in range(0, tokens(rank), 2):
        f[t] = torch.tensor([(t + rank) % E, (t + rank + 3) % E, (t + rank + 5) % E])
    return f


def shard(t: torch.Tensor, idx: int, world: int) -> torch.Tensor:
    per = t.shape[0] // world
    return t[idx * per:(idx + 1) * per].contiguous()


def global_routing(members, width=L, dtype=torch.float32, forced=None):
    """The spec router on all members' tokens (rebuilt from the seeds, not exchanged), sliced per member: torch's
    CPU sigmoid takes another code path for the elements of a tensor's tail (numel % 32), so the router's weights on
    one rank's tokens can differ in the last bit from the same tokens' in the whole batch; the experts' tests feed
    both sides the same routing."""
    from k3_kernels.moe.naive import naive_router

    rw, rb = params(width, dtype=dtype)[:2]
    x = torch.cat([inputs(i, width, dtype)[0] for i in range(len(members))])
    ids, w = naive_router(x, rw, rb, K, forced=forced)
    out, start = [], 0
    for i in range(len(members)):
        out.append((ids[start:start + tokens(i)], w[start:start + tokens(i)]))
        start += tokens(i)
    return out


def experts_fwd_bwd(rank_in_group, members, group, config, dtype=torch.float32):
    """ep_moe_experts on the global routing: y and the gradients of x, the gate weights and the expert shards."""
    from k3_kernels.moe_ep import ep_moe_experts

    world = len(members)
    _, _, w1, w3, w2 = params(dtype=dtype)
    w1, w3, w2 = (shard(t, rank_in_group, world).requires_grad_() for t in (w1, w3, w2))
    ids, w = global_routing(members, dtype=dtype)[rank_in_group]
    w = w.clone().requires_grad_()
    x, g = inputs(rank_in_group, dtype=dtype)
    x.requires_grad_()
    y = ep_moe_experts(x, ids, w, w1, w3, w2, E, group, config)
    (y.float() * g.float()).sum().backward()
    return {"y": y.detach(), "dx": x.grad, "dw": w.grad, "dw1": w1.grad, "dw3": w3.grad, "dw2": w2.grad}


def layer_fwd_bwd(rank_in_group, world, group, config, dtype=torch.float32, forced=None):
    """ep_moe_layer (router on this rank's tokens): y, ids and the gradients of x and the router / expert weights."""
    from k3_kernels.moe_ep import ep_moe_layer

    rw, rb, w1, w3, w2 = params(dtype=dtype)
    rw = rw.clone().requires_grad_()
    w1, w3, w2 = (shard(t, rank_in_group, world).requires_grad_() for t in (w1, w3, w2))
    x, g = inputs(rank_in_group, dtype=dtype)
    x.requires_grad_()
    y, ids = ep_moe_layer(x, rw, rb, w1, w3, w2, K, group, config, forced=forced)
    (y.float() * g.float()).sum().backward()
    return {"y": y.detach(), "ids": ids, "dx": x.grad, "drw": rw.grad, "dw1": w1.grad, "dw3": w3.grad,
            "dw2": w2.grad}


def bad_inputs(rank, world, group):
    from k3_kernels.moe_ep import EPConfig, ep_moe_layer

    rw, rb, w1, w3, w2 = params()
    x, _ = inputs(rank)
    loc = [shard(t, rank, world) for t in (w1, w3, w2)]
    out = {}
    # 6 experts over 4 ranks
    rw6, rb6, w16, w36, w26 = params(n_experts=6)
    out["not_divisible"] = error_text(lambda: ep_moe_layer(x, rw6, rb6, w16[:1], w36[:1], w26[:1], K, group))
    # rank 1 passes bf16 tokens (and bf16 weights: locally consistent), the others fp32
    if rank == 1:
        out["dtype_mismatch"] = error_text(lambda: ep_moe_layer(x.bfloat16(), rw.bfloat16(), rb,
                                                            *[t.bfloat16() for t in loc], K, group))
    else:
        out["dtype_mismatch"] = error_text(lambda: ep_moe_layer(x, rw, rb, *loc, K, group))
    # rank 2's w1 shard has the wrong intermediate size
    bad = [loc[0][:, :-1].contiguous(), *loc[1:]] if rank == 2 else loc
    out["bad_shape_one_rank"] = error_text(lambda: ep_moe_layer(x, rw, rb, *bad, K, group))
    # micro-batch count differs on rank 3
    cfg = EPConfig(micro_batches=3 if rank == 3 else 2)
    out["config_mismatch"] = error_text(lambda: ep_moe_layer(x, rw, rb, *loc, K, group, cfg))
    # FP8 dispatch under autograd (forward-only), on every rank
    xg = x.clone().requires_grad_()
    out["fp8_training"] = error_text(lambda: ep_moe_layer(xg, rw, rb, *loc, K, group, EPConfig(fp8=True)))
    # only rank 1 records the graph (its backward's exchanges would wait for peers that never run one)
    xa = x.clone().requires_grad_(rank == 1)
    out["autograd_mismatch"] = error_text(lambda: ep_moe_layer(xa, rw, rb, *loc, K, group))
    # more micro-batches than tokens on rank 0 (empty micro-batches): still the layer
    few = x[:2] if rank == 0 else x
    with torch.no_grad():
        out["few_tokens"] = ep_moe_layer(few, rw, rb, *loc, K, group, EPConfig(micro_batches=4))[0]
    # then a good call still works
    with torch.no_grad():
        out["after"] = ep_moe_layer(x, rw, rb, *loc, K, group)[0]
    return out


def run_battery(rank: int, world: int, store_dir: str) -> dict:
    from k3_kernels.moe_ep import Compute, EPConfig, ep_moe_experts

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=world)
    groups = {name: dist.new_group(list(ranks)) for name, ranks in GROUPS.items()}
    out: dict = {}
    for gname, members in GROUPS.items():
        if rank not in members:
            continue
        gr, group = members.index(rank), groups[gname]
        for m in (1, 3):
            cfg = EPConfig(micro_batches=m, ring_slots=2)
            out[(gname, f"experts_m{m}")] = experts_fwd_bwd(gr, members, group, cfg)
            out[(gname, f"layer_m{m}")] = layer_fwd_bwd(gr, len(members), group, cfg)
        out[(gname, "experts_m3_again")] = experts_fwd_bwd(gr, members, group, EPConfig(micro_batches=3))
        if gname == "pair":  # the GPU path's math: the moe Triton kernels, here in the interpreter
            for m in (1, 3):
                cfg = EPConfig(micro_batches=m, compute=Compute.KERNELS)
                out[(gname, f"kernels_m{m}")] = experts_fwd_bwd(gr, members, group, cfg)
    group, members = groups["world"], GROUPS["world"]
    out["bf16"] = experts_fwd_bwd(rank, members, group, EPConfig(micro_batches=1), dtype=torch.bfloat16)
    out["replay"] = layer_fwd_bwd(rank, world, group, EPConfig(micro_batches=2), forced=forced_ids(rank))
    rw8, rb8, w18, w38, w28 = params(L8, I8)
    x8, _ = inputs(rank, L8)
    ids8, wt8 = global_routing(members, L8)[rank]
    with torch.no_grad():
        out["fp8"] = ep_moe_experts(x8, ids8, wt8, *[shard(t, rank, world) for t in (w18, w38, w28)], E, group,
                                    EPConfig(micro_batches=1, fp8=True))
    if rank < 2:  # the kernels' FP8 dispatch (permute_rows quantising into the slot) on the pair group
        pair, members2 = groups["pair"], GROUPS["pair"]
        ids2, wt2 = global_routing(members2, L8)[rank]
        with torch.no_grad():
            out["fp8_kernels"] = ep_moe_experts(x8, ids2, wt2, *[shard(t, rank, 2) for t in (w18, w38, w28)], E, pair,
                                                EPConfig(micro_batches=2, fp8=True, compute=Compute.KERNELS))
    out["errors"] = bad_inputs(rank, world, group)
    dist.barrier()
    dist.destroy_process_group()
    return out
