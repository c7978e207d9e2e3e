"""The expert-parallel MoE pipeline (k3_kernels.moe_ep) on CPU: 4 gloo ranks spawned once (the world of 4 and a
pair group of ranks 0, 1; token counts 12 / 18 / 24 / 30 by rank), compared with the single-device layer over all
experts on all ranks' tokens (naive_ep_layer / the moe spec).

* Experts given the same routing, one micro-batch: y, the token, gate and expert-weight gradients are the spec's
  bits on every rank (fp32 and bf16; the FP8 dispatch vs naive_experts_fp8): the dispatch hands every expert the
  spec's rows in the spec's order.
* Several micro-batches: within fp32 rounding of the spec, and bitwise across runs. Not bitwise vs the spec on CPU
  because torch's CPU kernels are not batch-invariant: a 1..4-row matmul takes other kernels than a longer one, and
  the sigmoid of a tensor's tail elements (numel % 32) another code path, so the same row's bits depend on its
  micro-batch (the moe Triton kernels use one tile configuration for every row count: the GPU test checks there).
  The router on one rank's tokens likewise (its weights within rounding; its ids equal).
* The replicated router's gradient summed over ranks: tolerance (a sum over ranks is inherent).
* Router Replay's forced ids flow through; bad input raises on every rank before any rows move, and the group
  still works after."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _moe_ep_workers import E, GROUPS, I8, K, L8, forced_ids, global_routing, inputs, params  # noqa: E402

from k3_kernels.moe.naive import naive_experts, naive_experts_fp8  # noqa: E402
from k3_kernels.moe_ep import EPConfig, micro_batch_bounds, naive_ep_layer, schedule  # noqa: E402

WORLD = 4
TOL = dict(rtol=1e-5, atol=1e-6)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                        b.contiguous().view(torch.uint8))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What every rank of one 4-rank gloo world returned (spawned once for the module)."""
    from _moe_ep_workers import run_battery
    from _spawned_ranks import spawn_ranks

    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("moe_ep")
    return spawn_ranks(run_battery, WORLD, d)


def spec_experts(members, dtype=torch.float32):
    """naive_experts over all experts on the members' tokens with the global routing, and its gradients."""
    _, _, w1, w3, w2 = params(dtype=dtype)
    w1, w3, w2 = (t.clone().requires_grad_() for t in (w1, w3, w2))
    xs, gs = zip(*(inputs(i, dtype=dtype) for i in range(len(members))))
    routing = global_routing(members, dtype=dtype)
    xs = [x.clone().requires_grad_() for x in xs]
    ws = [w.clone().requires_grad_() for _, w in routing]
    y = naive_experts(torch.cat(xs), torch.cat([i for i, _ in routing]), torch.cat(ws), w1, w3, w2)
    (y.float() * torch.cat(gs).float()).sum().backward()
    ys = y.detach().split([x.shape[0] for x in xs])
    return ys, [x.grad for x in xs], [w.grad for w in ws], (w1.grad, w3.grad, w2.grad)


def spec_layer(members):
    rw, rb, w1, w3, w2 = params()
    rw, w1, w3, w2 = (t.clone().requires_grad_() for t in (rw, w1, w3, w2))
    xs, gs = zip(*(inputs(i) for i in range(len(members))))
    xs = [x.clone().requires_grad_() for x in xs]
    outs = naive_ep_layer(xs, rw, rb, w1, w3, w2, K)
    sum((y * g).sum() for (y, _), g in zip(outs, gs)).backward()
    return outs, [x.grad for x in xs], rw.grad, (w1.grad, w3.grad, w2.grad)


def check(got, want, bitwise, what):
    if bitwise:
        assert same_bits(got, want), (what, (got.float() - want.float()).abs().max())
    else:
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("gname", list(GROUPS))
@pytest.mark.parametrize("m", [1, 3])
def test_experts_match_the_single_device_layer(ranks, gname, m):
    """y, dx, d(gate weights), d(expert weights) per rank vs the spec: bitwise with 1 micro-batch, fp32 rounding
    with 3 (3 micro-batches over 2 ring slots: slots reused)."""
    members = GROUPS[gname]
    ys, dxs, dws, dW = spec_experts(members)
    per = E // len(members)
    for i, r in enumerate(members):
        got = ranks[r][(gname, f"experts_m{m}")]
        for key, want in (("y", ys[i]), ("dx", dxs[i]), ("dw", dws[i])):
            check(got[key], want, m == 1, (gname, m, r, key))
        for key, full in zip(("dw1", "dw3", "dw2"), dW):
            check(got[key], full[i * per:(i + 1) * per], m == 1, (gname, m, r, key))


@pytest.mark.parametrize("gname", list(GROUPS))
@pytest.mark.parametrize("m", [1, 3])
def test_layer_with_the_router_on_each_rank(ranks, gname, m):
    """ep_moe_layer: the ids are the spec's; y, dx, the expert shards' gradients within fp32 rounding; the
    router weight's gradient summed over ranks (in rank order) within tolerance."""
    members = GROUPS[gname]
    outs, dxs, drw, dW = spec_layer(members)
    per = E // len(members)
    for i, r in enumerate(members):
        got = ranks[r][(gname, f"layer_m{m}")]
        assert torch.equal(got["ids"], outs[i][1])
        check(got["y"], outs[i][0].detach(), False, (gname, m, r, "y"))
        check(got["dx"], dxs[i], False, (gname, m, r, "dx"))
        for key, full in zip(("dw1", "dw3", "dw2"), dW):
            check(got[key], full[i * per:(i + 1) * per], False, (gname, m, r, key))
    total = torch.stack([ranks[r][(gname, f"layer_m{m}")]["drw"] for r in members]).sum(0)
    torch.testing.assert_close(total, drw, **TOL)


def spec_kernels(members):
    """The single-device moe layer (Triton kernels, in the interpreter here) on the members' tokens."""
    from k3_kernels.moe import moe_experts

    _, _, w1, w3, w2 = params()
    w1, w3, w2 = (t.clone().requires_grad_() for t in (w1, w3, w2))
    xs, gs = zip(*(inputs(i) for i in range(len(members))))
    routing = global_routing(members)
    xs = [x.clone().requires_grad_() for x in xs]
    ws = [w.clone().requires_grad_() for _, w in routing]
    y = moe_experts(torch.cat(xs), torch.cat([i for i, _ in routing]), torch.cat(ws), w1, w3, w2)
    (y * torch.cat(gs)).sum().backward()
    return y.detach().split([x.shape[0] for x in xs]), [x.grad for x in xs], [w.grad for w in ws], \
        (w1.grad, w3.grad, w2.grad)


@pytest.mark.parametrize("m", [1, 3])
def test_kernel_path_matches_the_single_device_kernels(ranks, m):
    """Compute.KERNELS (the GPU path: plan_routing, permute_rows into the ring slot, moe_experts, the combine
    kernels) in Triton's interpreter on 2 ranks: y, dx and the gate gradients are the single-device moe layer's
    bits with 1 and with 3 micro-batches (its kernels use one tile configuration for any row count); expert
    weights bitwise with 1, within fp32 rounding with 3."""
    members = GROUPS["pair"]
    ys, dxs, dws, dW = spec_kernels(members)
    for i, r in enumerate(members):
        got = ranks[r][("pair", f"kernels_m{m}")]
        for key, want in (("y", ys[i]), ("dx", dxs[i]), ("dw", dws[i])):
            check(got[key], want, True, (m, r, key))
        for key, full in zip(("dw1", "dw3", "dw2"), dW):
            check(got[key], full[i * 4:(i + 1) * 4], m == 1, (m, r, key))


def test_repeat_runs_give_the_same_bits(ranks):
    for gname, members in GROUPS.items():
        for r in members:
            a, b = ranks[r][(gname, "experts_m3")], ranks[r][(gname, "experts_m3_again")]
            for key in a:
                assert same_bits(a[key], b[key]), (gname, r, key)


def test_bf16_matches_the_spec(ranks):
    """bf16 tokens and weights, one micro-batch: y, dx and the weight gradients bitwise the spec's (the token
    gradient summed in bf16 in the order of the spec's index backward)."""
    ys, dxs, dws, dW = spec_experts(GROUPS["world"], torch.bfloat16)
    for r in range(WORLD):
        got = ranks[r]["bf16"]
        assert got["y"].dtype == torch.bfloat16
        for key, want in (("y", ys[r]), ("dx", dxs[r]), ("dw", dws[r])):
            check(got[key], want, True, (r, key))
        for key, full in zip(("dw1", "dw3", "dw2"), dW):
            check(got[key], full[r * 2:(r + 1) * 2], True, (r, key))


def test_fp8_dispatch_matches_the_fp8_spec(ranks):
    """e4m3 rows + 1 x 128 scales staged on the source rank and exchanged: naive_experts_fp8's bits (the spec
    quantises the same rows the same way), and not the unquantised layer's (FP8 is real)."""
    _, _, w1, w3, w2 = params(L8, I8)
    x = torch.cat([inputs(r, L8)[0] for r in range(WORLD)])
    routing = global_routing(GROUPS["world"], L8)
    ids, w = torch.cat([i for i, _ in routing]), torch.cat([w for _, w in routing])
    spec = naive_experts_fp8(x, ids, w, w1, w3, w2).split([r[0].shape[0] for r in routing])
    exact = naive_experts(x, ids, w, w1, w3, w2).split([r[0].shape[0] for r in routing])
    for r in range(WORLD):
        y = ranks[r]["fp8"]
        assert same_bits(y, spec[r]), r
        assert not torch.equal(y, exact[r])


def test_fp8_kernel_dispatch_matches_the_single_device_fp8_layer(ranks):
    """The kernels' FP8 path (e4m3 rows + scales written by permute_rows into the ring slot, exchanged, the FP8
    grouped GEMMs on them; interpreter, 2 ranks, 2 micro-batches) == moe_experts(precision=FP8) on one device."""
    from k3_kernels.moe import Precision, moe_experts

    _, _, w1, w3, w2 = params(L8, I8)
    members = GROUPS["pair"]
    x = torch.cat([inputs(r, L8)[0] for r in members])
    routing = global_routing(members, L8)
    with torch.no_grad():
        y = moe_experts(x, torch.cat([i for i, _ in routing]), torch.cat([w for _, w in routing]), w1, w3, w2,
                        precision=Precision.FP8)
    for r, want in zip(members, y.split([i.shape[0] for i, _ in routing])):
        assert same_bits(ranks[r]["fp8_kernels"], want), r


def test_router_replay_flows_through(ranks):
    """Forced rows get exactly the forced ids, free rows the router's (the spec's with the same forced ids)."""
    rw, rb, w1, w3, w2 = params()
    xs = [inputs(r)[0] for r in range(WORLD)]
    forced = [forced_ids(r) for r in range(WORLD)]
    spec = naive_ep_layer(xs, rw, rb, w1, w3, w2, K, forced=forced)
    for r in range(WORLD):
        got, f = ranks[r]["replay"], forced[r]
        fixed = f[:, 0] >= 0
        assert fixed.any() and (~fixed).any()
        assert torch.equal(got["ids"][fixed], f[fixed])
        assert torch.equal(got["ids"], spec[r][1])
        torch.testing.assert_close(got["y"], spec[r][0], **TOL)


@pytest.mark.parametrize("case,needle", [("not_divisible", "not divisible by the 4 ranks"),
                                         ("dtype_mismatch", "dtype differs across ranks"),
                                         ("bad_shape_one_rank", "bad input on rank(s) [2]"),
                                         ("config_mismatch", "micro_batches differs across ranks"),
                                         ("fp8_training", "FP8 dispatch is forward-only"),
                                         ("autograd_mismatch", "autograd (grad enabled")])
def test_bad_input_raises_on_every_rank(ranks, case, needle):
    for r in range(WORLD):
        msg = ranks[r]["errors"][case]
        assert msg.startswith("ValueError") and needle in msg, (case, r, msg)
    if case == "bad_shape_one_rank":  # the offending rank names the tensor
        assert "w3: expected" in ranks[2]["errors"][case]


def test_group_still_works_after_bad_input(ranks):
    rw, rb, w1, w3, w2 = params()
    spec = naive_ep_layer([inputs(r)[0] for r in range(WORLD)], rw, rb, w1, w3, w2, K)
    for r in range(WORLD):
        torch.testing.assert_close(ranks[r]["errors"]["after"], spec[r][0], **TOL)


def test_empty_micro_batches(ranks):
    """Rank 0 with 2 tokens and 4 micro-batches (two of them empty on that rank) still gives the layer."""
    rw, rb, w1, w3, w2 = params()
    xs = [inputs(r)[0] for r in range(WORLD)]
    xs[0] = xs[0][:2]
    spec = naive_ep_layer(xs, rw, rb, w1, w3, w2, K)
    for r in range(WORLD):
        torch.testing.assert_close(ranks[r]["errors"]["few_tokens"], spec[r][0], **TOL)


def test_schedule_overlaps_three_stages():
    """Step s: dispatch s, experts s - 1, combine s - 2; every micro-batch passes each stage once, in order."""
    steps = schedule(4)
    assert len(steps) == 6
    assert steps[2].dispatch == 2 and steps[2].experts == 1 and steps[2].combine == 0
    for stage in ("dispatch", "experts", "combine"):
        assert [getattr(s, stage) for s in steps if getattr(s, stage) is not None] == [0, 1, 2, 3]
    assert micro_batch_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert micro_batch_bounds(1, 3) == [(0, 1), (1, 1), (1, 1)]


def test_ring_buffer_bounds_and_reuses_its_slots():
    """Micro-batch i is staged in slot i % ring_slots: the same storage again two micro-batches later (grown only
    for a larger micro-batch); FP8 slots hold e4m3 rows and fp32 1 x 128 scales."""
    from k3_kernels.moe_ep.dispatch import RingBuffer
    from k3_kernels.moe_ep.plan import slot_of

    cfg = EPConfig(micro_batches=5, ring_slots=2)
    ring = RingBuffer(cfg, 16, torch.float32, torch.device("cpu"))
    ptrs = [ring.send_slot(slot_of(i, cfg), 10)["rows"].data_ptr() for i in range(5)]
    assert ptrs[0] == ptrs[2] == ptrs[4] and ptrs[1] == ptrs[3] and ptrs[0] != ptrs[1]
    assert ring.send_slot(0, 4)["rows"].data_ptr() == ptrs[0]          # smaller: reused
    assert ring.send_slot(0, 40)["rows"].shape[0] == 40               # larger: grown
    assert len(ring.send) == len(ring.recv) == 2
    fp8 = RingBuffer(EPConfig(fp8=True), 256, torch.bfloat16, torch.device("cpu")).send_slot(1, 3)
    assert fp8["rows"].dtype == torch.float8_e4m3fn and fp8["scales"].shape == (3, 2)


@pytest.mark.parametrize("kwargs", [{"micro_batches": 0}, {"ring_slots": 1}, {"fp8": 1}, {"compute": "kernels"}])
def test_config_refuses_bad_values(kwargs):
    with pytest.raises((ValueError, TypeError), match=next(iter(kwargs))):
        EPConfig(**kwargs)
