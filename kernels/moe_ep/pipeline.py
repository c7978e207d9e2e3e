"""The micro-batched expert-parallel forward and backward as one autograd Function, and the public API.

    y, ids = ep_moe_layer(x, router_weight, router_bias, w1, w3, w2, top_k, group, EPConfig(...), forced=...)
    y = ep_moe_experts(x, ids, weights, w1, w3, w2, n_experts, group, EPConfig(...))

x [N, L]: this rank's tokens (N may differ across ranks); w1/w3 [E/W, I, L], w2 [E/W, L, I]: this rank's experts
(rank r holds experts [r E/W, (r + 1) E/W)). Forward, step s of plan.schedule: dispatch micro-batch s (sort, stage
into ring slot s % slots, counts then rows all_to_all), experts on micro-batch s - 1 (expert-major rows; the moe
kernels on CUDA, the spec otherwise), combine micro-batch s - 2 (rows back, weighted sum in slot order). Backward,
the same steps over the gradients: the combine's backward and the rows' gradients out, the experts' backward
(autograd through the saved per-micro-batch graph; weight gradients summed over micro-batches in order), the rows'
gradients back and the tokens' sum in sorted-row order.

CUDA: the three stages run on three streams ordered by events (micro-batch i's experts wait for its dispatch, its
combine for its experts; a ring slot is restaged only after the experts read the micro-batch it last held); each
call's side streams first wait for the caller's stream, and the caller's stream waits for them at the end, so the
caching allocator's reuse across calls is ordered. gloo: the same steps one after the other, the same math."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import checks
from .combine import combine_grads, return_rows, sum_row_grads, weighted_sum
from .dispatch import RingBuffer, Route, exchange, plan_micro_batch, send_rows, stage
from .naive import naive_local_experts, naive_local_experts_fp8
from .plan import EPConfig, micro_batch_bounds, schedule, slot_of

_STAGES = ("dispatch", "experts", "combine")


@dataclass(frozen=True)
class _Call:
    group: object
    world: int
    n_experts: int
    config: EPConfig
    beta: float
    linear_beta: float
    training: bool


@dataclass
class _MicroBatch:
    route: Route | None = None
    received: dict = field(default_factory=dict)
    rows_em: torch.Tensor | None = None   # expert-major rows (leaf of the experts' graph when training)
    y_em: torch.Tensor | None = None
    y_sm: torch.Tensor | None = None      # expert outputs, source-major (what is sent back)
    y_ret: torch.Tensor | None = None     # this rank's pairs' outputs, sorted-row order
    dy_recv: torch.Tensor | None = None
    drows_sm: torch.Tensor | None = None
    events: dict = field(default_factory=dict)


class _Streams:
    """CUDA: one stream per stage, events between them; elsewhere the stages run inline."""

    def __init__(self, device: torch.device) -> None:
        self.cuda, self.device = device.type == "cuda", device
        if self.cuda:
            self.streams = {name: torch.cuda.Stream(device) for name in _STAGES}

    def begin(self) -> "_Streams":
        """The side streams wait for the caller's (also before the backward, which reuses the forward's streams:
        autograd runs an op's backward on its forward's stream)."""
        if self.cuda:
            self.main = torch.cuda.current_stream(self.device)
            for s in self.streams.values():
                s.wait_stream(self.main)
        return self

    def run(self, stage_name: str, waits, fn):
        if not self.cuda:
            fn()
            return None
        s = self.streams[stage_name]
        for e in waits:
            if e is not None:
                s.wait_event(e)
        with torch.cuda.stream(s):
            fn()
        ev = torch.cuda.Event()
        ev.record(s)
        return ev

    def finish(self) -> None:
        if self.cuda:
            for s in self.streams.values():
                self.main.wait_stream(s)


def _local_experts(rows: torch.Tensor, route: Route, w1, w3, w2, call: _Call) -> torch.Tensor:
    if route.kernels:
        from k3_kernels.moe.layer import Precision, moe_experts

        ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
        return moe_experts(rows, route.local_ids[:, None], ones, w1, w3, w2, call.beta, call.linear_beta,
                           Precision.BF16)
    return naive_local_experts(rows, route.local_ids, w1, w3, w2, call.beta, call.linear_beta)


def _local_experts_fp8(q, s, route: Route, w1, w3, w2, call: _Call, out_dtype) -> torch.Tensor:
    if route.kernels:
        from k3_kernels.moe import grouped_gemm as gg
        from k3_kernels.moe.layer import fp8_weight
        from k3_kernels.moe.permute import plan_routing

        plan = plan_routing(route.local_ids[:, None], w1.shape[0])  # already sorted: the identity order
        (w1q, w1s), (w3q, w3s), (w2q, w2s) = fp8_weight(w1), fp8_weight(w3), fp8_weight(w2)
        _, _, hq, hs = gg.gate_up(q, w1, w3, plan, call.beta, call.linear_beta, act_dtype=out_dtype, save_gu=False,
                                  write_h=False, quant_h=True, fp8=(q, s, w1q, w1s, w3q, w3s))
        return gg.down(hq, w2, plan, out_dtype, fp8=(hq, hs, w2q, w2s))
    return naive_local_experts_fp8(q, s, route.local_offsets, w1, w3, w2, call.beta, call.linear_beta, out_dtype)


def _source_major(t_em: torch.Tensor, route: Route) -> torch.Tensor:
    out = torch.empty_like(t_em)
    out.index_copy_(0, route.em, t_em)
    return out


class _EPExpertsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, w1, w3, w2, ids, call: _Call):
        cfg, group, k = call.config, call.group, ids.shape[1]
        N, L = x.shape
        bounds = micro_batch_bounds(N, cfg.micro_batches)
        ring = RingBuffer(cfg, L, x.dtype, x.device)
        streams = _Streams(x.device).begin()
        leaves = [t.detach().requires_grad_(call.training) for t in (w1, w3, w2)]
        mbs = [_MicroBatch() for _ in bounds]
        kernels = cfg.kernels(x.is_cuda)
        out = torch.empty(N, L, dtype=x.dtype, device=x.device)

        def dispatch(i):
            lo, hi = bounds[i]
            mb = mbs[i]
            mb.route = plan_micro_batch(ids, lo, hi, call.n_experts, call.world, group, kernels)
            slot = slot_of(i, cfg)
            staged = stage(x, mb.route, k, ring.send_slot(slot, (hi - lo) * k), cfg.fp8)
            mb.received = send_rows(staged, mb.route, ring.recv_slot(slot, mb.route.received), group)

        def experts(i):
            mb = mbs[i]
            em = mb.route.em
            if cfg.fp8:
                y = _local_experts_fp8(mb.received["rows"][em], mb.received["scales"][em], mb.route, *leaves,
                                       call, x.dtype)
            else:
                mb.rows_em = mb.received["rows"][em].requires_grad_(call.training)  # a copy: the slot is reused
                with torch.enable_grad():
                    y = _local_experts(mb.rows_em, mb.route, *leaves, call)
            mb.y_em = y if call.training else None
            mb.y_sm = _source_major(y.detach(), mb.route)

        def combine(i):
            mb = mbs[i]
            lo, hi = bounds[i]
            mb.y_ret = return_rows(mb.y_sm, mb.route, group)
            out[lo:hi] = weighted_sum(mb.y_ret, mb.route, w[lo:hi], x.dtype)
            mb.y_sm = None

        for step in schedule(cfg.micro_batches):
            if step.dispatch is not None:
                i = step.dispatch
                prev = i - cfg.ring_slots  # the micro-batch whose rows this slot last held
                waits = [mbs[prev].events.get("experts")] if prev >= 0 else []
                mbs[i].events["dispatch"] = streams.run("dispatch", waits, lambda i=i: dispatch(i))
            if step.experts is not None:
                i = step.experts
                mbs[i].events["experts"] = streams.run("experts", [mbs[i].events.get("dispatch")],
                                                       lambda i=i: experts(i))
            if step.combine is not None:
                i = step.combine
                mbs[i].events["combine"] = streams.run("combine", [mbs[i].events.get("experts")],
                                                       lambda i=i: combine(i))
        streams.finish()
        if call.training:
            for mb in mbs:
                mb.received, mb.events = {}, {}
            ctx.mbs, ctx.bounds, ctx.leaves, ctx.call, ctx.streams = mbs, bounds, leaves, call, streams
            ctx.save_for_backward(w)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        (w,) = ctx.saved_tensors
        mbs, bounds, leaves, call = ctx.mbs, ctx.bounds, ctx.leaves, ctx.call
        group = call.group
        dout = dout.contiguous()
        N, L = dout.shape
        dtype = leaves[0].dtype
        dx = torch.empty(N, L, dtype=dtype, device=dout.device)
        dw = torch.empty(w.shape, dtype=torch.float32, device=dout.device)
        dweights: list[torch.Tensor | None] = [None, None, None]
        streams = ctx.streams.begin()
        want_w = [ctx.needs_input_grad[2], ctx.needs_input_grad[3], ctx.needs_input_grad[4]]

        def grads_out(i):  # the combine's backward on the source rank, the rows' gradients to the experts
            mb, (lo, hi) = mbs[i], bounds[i]
            dy_rows, dw[lo:hi] = combine_grads(dout[lo:hi], mb.y_ret, mb.route, w[lo:hi])
            mb.dy_recv = dy_rows.new_empty(mb.route.received, L)
            exchange(mb.dy_recv, dy_rows, mb.route.recv_splits, mb.route.send_splits, group)
            mb.y_ret = None

        def experts_bwd(i):
            mb = mbs[i]
            dy_em = mb.dy_recv[mb.route.em]
            inputs = [mb.rows_em] + [t for t, want in zip(leaves, want_w) if want]
            got = torch.autograd.grad(mb.y_em, inputs, dy_em, allow_unused=True)
            drows = got[0] if got[0] is not None else torch.zeros_like(mb.rows_em)
            rest = iter(got[1:])
            for n, want in enumerate(want_w):
                if want:
                    g = next(rest)
                    g = torch.zeros_like(leaves[n]) if g is None else g
                    dweights[n] = g if dweights[n] is None else dweights[n] + g  # micro-batch order
            mb.drows_sm = _source_major(drows, mb.route)
            mb.y_em = mb.rows_em = mb.dy_recv = None

        def grads_back(i):
            mb, (lo, hi) = mbs[i], bounds[i]
            dxp = mb.drows_sm.new_empty(mb.route.sent, L)
            exchange(dxp, mb.drows_sm, mb.route.send_splits, mb.route.recv_splits, group)
            dx[lo:hi] = sum_row_grads(dxp, mb.route, dtype)
            mb.drows_sm = None

        for step in schedule(len(mbs)):
            if step.dispatch is not None:
                i = step.dispatch
                mbs[i].events["out"] = streams.run("dispatch", [], lambda i=i: grads_out(i))
            if step.experts is not None:
                i = step.experts
                mbs[i].events["experts"] = streams.run("experts", [mbs[i].events.get("out")],
                                                       lambda i=i: experts_bwd(i))
            if step.combine is not None:
                i = step.combine
                mbs[i].events["back"] = streams.run("combine", [mbs[i].events.get("experts")],
                                                    lambda i=i: grads_back(i))
        streams.finish()
        return dx, dw, dweights[0], dweights[1], dweights[2], None, None


def _group_world(group) -> tuple[object, int]:
    group = group if group is not None else dist.group.WORLD
    return group, dist.get_world_size(group)


def ep_moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                   w2: torch.Tensor, n_experts: int, group=None, config: EPConfig = EPConfig(), beta: float = 4.0,
                   linear_beta: float = 25.0, *, _problem: str | None = None) -> torch.Tensor:
    """sum_j weights[t, j] E_{ids[t, j]}(x[t]) over the expert group -> [N, L] in x's dtype (differentiable in x,
    weights and this rank's w1, w3, w2). Bad input raises ValueError on every rank before any rows move."""
    if not isinstance(config, EPConfig):
        raise TypeError(f"config: expected an EPConfig, got {config!r}")
    group, world = _group_world(group)
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (x, weights, w1, w3, w2))
    problem = _problem
    if problem is None and config.fp8 and training:
        problem = "config.fp8: the FP8 dispatch is forward-only (run it under torch.no_grad())"
    if problem is None and config.fp8 and x.dim() == 2 and x.shape[1] % 128:
        problem = f"x: FP8 dispatch needs a width divisible by 128, got {x.shape[1]}"
    checks.check_inputs(x, ids, weights, w1, w3, w2, n_experts, ids.shape[-1] if ids.dim() else 0, group, world,
                        config.fp8, config.micro_batches, config.ring_slots, config.check_across_ranks, problem,
                        training)
    call = _Call(group, world, n_experts, config, float(beta), float(linear_beta), training)
    return _EPExpertsFn.apply(x.contiguous(), weights.float(), w1.contiguous(), w3.contiguous(), w2.contiguous(),
                              ids.long().contiguous(), call)


def ep_moe_layer(x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor | None, w1: torch.Tensor,
                 w3: torch.Tensor, w2: torch.Tensor, top_k: int, group=None, config: EPConfig = EPConfig(),
                 beta: float = 4.0, linear_beta: float = 25.0, forced: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router (fused on CUDA, the spec elsewhere; Router Replay through `forced` [N, k], rows of -1 route freely)
    then ep_moe_experts -> (y [N, L], ids [N, k]: the routed experts, for replay). Spec: naive.naive_ep_layer."""
    group, world = _group_world(group)
    problem = checks.router_problem(x, router_weight, router_bias, top_k, forced)
    n_experts = router_weight.shape[0] if router_weight.dim() == 2 else 0
    if problem is None:
        problem = checks.local_problem(x, None, None, w1, w3, w2, n_experts, world)
    if problem is not None:  # every rank learns of it in the check; no router runs
        dummy = torch.zeros(x.shape[0] if x.dim() else 0, max(top_k, 1), dtype=torch.int64, device=x.device)
        checks.check_inputs(x, dummy, dummy.float(), w1, w3, w2, n_experts, top_k, group, world, config.fp8,
                            config.micro_batches, config.ring_slots, config.check_across_ranks, problem)
    if config.kernels(x.is_cuda):
        from k3_kernels.moe.router import fused_router

        ids, w = fused_router(x.contiguous(), router_weight, router_bias, top_k, forced=forced)
    else:
        from k3_kernels.moe.naive import naive_router

        ids, w = naive_router(x, router_weight, router_bias, top_k, forced=forced)
    return ep_moe_experts(x, ids, w, w1, w3, w2, n_experts, group, config, beta, linear_beta), ids
