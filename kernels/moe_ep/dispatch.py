"""Dispatch: a micro-batch's (token, slot) pairs sorted by expert (stable: within an expert by token, then slot),
staged into a ring-buffer slot (rows in the activation dtype, or e4m3 rows + 1 x 128 fp32 scales), counts then rows
exchanged with `all_to_all_single`, and the received rows' expert-major order.

Experts are contiguous by rank (rank d owns [d E/W, (d + 1) E/W)), so after the sort the rows for rank d are one
contiguous run: the send buffer is the sorted rows, split by destination. Rank d receives, from source s = 0..W-1
in order, s's rows for its experts (each source's sorted by expert, token, slot). Reading them expert by expert,
source by source gives expert e exactly the rows - and the order - that the single-device permutation of all ranks'
tokens (concatenated in rank order) gives it: that is what makes every GEMM and every sum bitwise the spec's.

Transport: gloo on CPU, NCCL's all_to_all_single on CUDA (a first step: the symmetric-memory puts of
k3_kernels.comm are not used yet, NOTES.md). Rows travel as bytes (uint8 views: gloo has no float8 / bfloat16)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from k3_kernels.moe.naive import naive_permutation, naive_quant_rows

from .plan import EPConfig

QUANT_BLOCK = 128


@dataclass
class Route:
    """One micro-batch's routing, on its source rank and on its expert rank."""
    lo: int
    hi: int
    order: torch.Tensor          # [P] pair id (t k + j, t local to the micro-batch) of each sorted row
    pos: torch.Tensor            # [n, k] sorted row of each pair
    send_splits: list[int]       # rows to each destination rank
    recv_splits: list[int]       # rows from each source rank
    em: torch.Tensor             # [R] expert-major order: received row (source-major) of each expert-major row
    local_ids: torch.Tensor      # [R] local expert of each expert-major row (ascending)
    local_offsets: torch.Tensor  # [E_local + 1]
    kernels: bool                # the moe Triton kernels run the local work (else the spec)

    @property
    def sent(self) -> int:
        return sum(self.send_splits)

    @property
    def received(self) -> int:
        return sum(self.recv_splits)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """[R, D] -> [R, D * itemsize] uint8 (same storage)."""
    if t.dtype == torch.uint8:
        return t
    return t.view(torch.uint8).view(t.shape[0], t.shape[1] * t.element_size())


def exchange(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> None:
    """Rows of `inp` split by destination -> `out` split by source (both [*, D], contiguous rows)."""
    dist.all_to_all_single(as_bytes(out), as_bytes(inp), out_splits, in_splits, group=group)


class RingBuffer:
    """Dispatch staging: `slots` send and receive buffers, grown to the largest micro-batch seen (sizes are
    per-call bounds: send <= n k rows, receive <= W n k rows for a micro-batch of n tokens)."""

    def __init__(self, config: EPConfig, width: int, dtype: torch.dtype, device: torch.device) -> None:
        self.config, self.width, self.dtype, self.device = config, width, dtype, device
        self.send: list[dict[str, torch.Tensor]] = [{} for _ in range(config.ring_slots)]
        self.recv: list[dict[str, torch.Tensor]] = [{} for _ in range(config.ring_slots)]

    def _get(self, table: list, slot: int, rows: int) -> dict[str, torch.Tensor]:
        bufs = table[slot]
        if not bufs or bufs["rows"].shape[0] < rows:
            rows = max(rows, 1)
            if self.config.fp8:
                bufs["rows"] = torch.empty(rows, self.width, dtype=torch.float8_e4m3fn, device=self.device)
                bufs["scales"] = torch.empty(rows, self.width // QUANT_BLOCK, dtype=torch.float32,
                                             device=self.device)
            else:
                bufs["rows"] = torch.empty(rows, self.width, dtype=self.dtype, device=self.device)
        return bufs

    def send_slot(self, slot: int, rows: int) -> dict[str, torch.Tensor]:
        return self._get(self.send, slot, rows)

    def recv_slot(self, slot: int, rows: int) -> dict[str, torch.Tensor]:
        return self._get(self.recv, slot, rows)


def sort_pairs(ids: torch.Tensor, n_experts: int, kernels: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, pos, counts [E]) of the stable sort by expert (the spec's naive_permutation, or the moe kernels'
    plan_routing: the same sort)."""
    if kernels:
        from k3_kernels.moe.permute import plan_routing

        plan = plan_routing(ids, n_experts)
        return plan.order, plan.pos, plan.counts
    order, pos, offsets = naive_permutation(ids, n_experts)
    return order, pos, offsets[1:] - offsets[:-1]


def plan_micro_batch(ids: torch.Tensor, lo: int, hi: int, n_experts: int, world: int, group, kernels: bool
                     ) -> Route:
    """Sort the micro-batch's pairs, exchange the per-expert counts (one all_to_all of W x E/W int64), and derive
    both sides' splits and the expert-major order of what this rank will receive."""
    per = n_experts // world
    order, pos, counts = sort_pairs(ids[lo:hi], n_experts, kernels)
    send_counts = counts.to(torch.int64).contiguous()
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)  # [W src, E/W] after the view below
    recv_counts = recv_counts.view(world, per)
    send_splits = send_counts.view(world, per).sum(1).tolist()
    recv_splits = recv_counts.sum(1).tolist()
    # expert-major order of the received (source-major) rows
    flat = recv_counts.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat                         # block (s, e) in the source-major rows
    cnt_em = recv_counts.t().reshape(-1)                          # blocks (e, s), e-major
    start_em = starts.view(world, per).t().reshape(-1)
    R = int(flat.sum())
    dev = ids.device
    first_em = torch.cumsum(cnt_em, 0) - cnt_em
    within = torch.arange(R, device=dev) - torch.repeat_interleave(first_em, cnt_em)
    em = torch.repeat_interleave(start_em, cnt_em) + within
    block_expert = torch.arange(per, device=dev).repeat_interleave(world)
    local_ids = torch.repeat_interleave(block_expert, cnt_em)
    local_offsets = torch.zeros(per + 1, dtype=torch.int64, device=dev)
    local_offsets[1:] = torch.cumsum(recv_counts.sum(0), 0)
    return Route(lo, hi, order, pos, send_splits, recv_splits, em, local_ids, local_offsets, kernels)


def stage(x: torch.Tensor, route: Route, top_k: int, slot: dict[str, torch.Tensor], fp8: bool
          ) -> dict[str, torch.Tensor]:
    """Write the micro-batch's sorted rows into the send slot (FP8: with the kernels quantised in the same pass,
    permute_rows writing e4m3 rows and scales straight into the buffers) -> views of the written rows."""
    P = route.sent
    xm = x[route.lo:route.hi]
    if route.kernels:
        from k3_kernels.moe.permute import RoutingPlan, permute_rows

        plan = RoutingPlan(route.order, route.pos, torch.empty(0), torch.empty(0), 0, top_k)
        if fp8:
            _, q, s = permute_rows(xm.contiguous(), plan, bf16=False, fp8=True, out_q=slot["rows"],
                                   out_scale=slot["scales"])
            return {"rows": q, "scales": s}
        rows, _, _ = permute_rows(xm.contiguous(), plan, out=slot["rows"])
        return {"rows": rows}
    src = route.order // top_k
    if fp8:
        q, s = naive_quant_rows(xm[src])
        slot["rows"][:P].copy_(q)
        slot["scales"][:P].copy_(s)
        return {"rows": slot["rows"][:P], "scales": slot["scales"][:P]}
    torch.index_select(xm, 0, src, out=slot["rows"][:P])
    return {"rows": slot["rows"][:P]}


def send_rows(staged: dict[str, torch.Tensor], route: Route, slot: dict[str, torch.Tensor], group
              ) -> dict[str, torch.Tensor]:
    """The rows exchange (and the scales' with FP8) into the receive slot -> views of the received rows."""
    R = route.received
    out = {}
    for key, t in staged.items():
        dst = slot[key][:R]
        exchange(dst, t, route.recv_splits, route.send_splits, group)
        out[key] = dst
    return out
