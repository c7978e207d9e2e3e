"""Input checks of the EP layer before any row moves: local ones (shapes, dtypes, expert ids in range, the expert
count divisible by the ranks) and one small all-gather of every rank's verdict and metadata, so that bad input on
any rank, or shapes / dtypes that differ across ranks, raise the same ValueError on every rank (a rank raising
alone would leave its peers waiting in the all_to_all)."""
from __future__ import annotations

import torch

from k3_kernels.comm.process_group import all_gather_rows

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def router_problem(x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor | None, top_k: int,
                   forced: torch.Tensor | None) -> str | None:
    """The router's inputs (checked before the router runs, so that no rank raises alone)."""
    if x.dim() != 2:
        return f"x: expected [N, L], got shape {tuple(x.shape)}"
    if router_weight.dim() != 2 or router_weight.shape[1] != x.shape[1] or router_weight.dtype != x.dtype:
        return f"router_weight: expected [E, {x.shape[1]}] {x.dtype}, got {tuple(router_weight.shape)} " \
               f"{router_weight.dtype}"
    E = router_weight.shape[0]
    if not 0 < top_k <= E:
        return f"top_k: must be in [1, {E}], got {top_k}"
    if router_bias is not None and router_bias.shape != (E,):
        return f"router_bias: expected [{E}], got {tuple(router_bias.shape)}"
    if forced is not None:
        if forced.shape != (x.shape[0], top_k):
            return f"forced: expected [{x.shape[0]}, {top_k}], got {tuple(forced.shape)}"
        if forced.numel() and int(forced.max()) >= E:
            return f"forced: expert ids must lie in [0, {E}) (or -1: route freely), got max {int(forced.max())}"
    return None


def local_problem(x: torch.Tensor, ids: torch.Tensor | None, weights: torch.Tensor | None, w1: torch.Tensor,
                  w3: torch.Tensor, w2: torch.Tensor, n_experts: int, world: int, top_k: int | None = None
                  ) -> str | None:
    """A message naming the offending field, or None (ids / weights None: they come from the router later)."""
    if x.dim() != 2:
        return f"x: expected [N, L], got shape {tuple(x.shape)}"
    if x.dtype not in _DTYPES:
        return f"x: expected a float dtype, got {x.dtype}"
    N, L = x.shape
    if n_experts % world:
        return f"n_experts: {n_experts} experts are not divisible by the {world} ranks of the expert group"
    per = n_experts // world
    if w1.dim() != 3 or w1.shape[0] != per or w1.shape[2] != L:
        return f"w1: expected this rank's [{per}, I, {L}] ({n_experts} experts / {world} ranks), got {tuple(w1.shape)}"
    I = w1.shape[1]
    if w3.shape != w1.shape:
        return f"w3: expected {tuple(w1.shape)}, got {tuple(w3.shape)}"
    if w2.shape != (per, L, I):
        return f"w2: expected [{per}, {L}, {I}], got {tuple(w2.shape)}"
    for name, t in (("w1", w1), ("w3", w3), ("w2", w2)):
        if t.dtype != x.dtype:
            return f"{name}: dtype {t.dtype}, x is {x.dtype}"
        if t.device != x.device:
            return f"{name}: on {t.device}, x on {x.device}"
    if ids is None:
        return None
    if ids.dim() != 2 or ids.shape[0] != N:
        return f"ids: expected [{N}, k], got {tuple(ids.shape)}"
    if ids.dtype not in (torch.int32, torch.int64):
        return f"ids: expected int32/int64, got {ids.dtype}"
    if weights.shape != ids.shape:
        return f"weights: expected {tuple(ids.shape)}, got {tuple(weights.shape)}"
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n_experts):
        return f"ids: expert ids must lie in [0, {n_experts}), got [{int(ids.min())}, {int(ids.max())}]"
    return None


def _meta(problem: str | None, x, top_k: int, w1, fp8: bool, micro_batches: int, ring_slots: int,
          training: bool) -> list[int]:
    if problem is not None:
        return [1] + [0] * len(_FIELDS)
    code = _DTYPES.index(x.dtype)
    return [0, x.shape[1], top_k, w1.shape[0], w1.shape[1], code, int(fp8), micro_batches, ring_slots,
            int(training)]


# "autograd": a rank that records the graph will run the backward's exchanges; every rank must.
_FIELDS = ("latent width L", "top_k", "local experts", "intermediate I", "dtype", "fp8", "micro_batches",
           "ring_slots", "autograd (grad enabled with a tensor requiring grad)")


def check_inputs(x, ids, weights, w1, w3, w2, n_experts: int, top_k: int, group, world: int, fp8: bool,
                 micro_batches: int, ring_slots: int, across_ranks: bool, problem: str | None = None,
                 training: bool = False) -> None:
    """Raise ValueError (on every rank with across_ranks) before any exchange; `problem`: one found earlier
    (the router's inputs, autograd with FP8)."""
    problem = problem or local_problem(x, ids, weights, w1, w3, w2, n_experts, world)
    if not across_ranks:
        if problem:
            raise ValueError(f"moe_ep: {problem}")
        return
    mine = torch.tensor(_meta(problem, x, top_k, w1, fp8, micro_batches, ring_slots, training), dtype=torch.int64,
                        device=x.device)
    rows = all_gather_rows(mine, group).cpu().tolist()
    bad = [r for r, row in enumerate(rows) if row[0]]
    if bad:
        here = f" (here: {problem})" if problem else ""
        raise ValueError(f"moe_ep: bad input on rank(s) {bad} of the expert group{here}")
    for i, field in enumerate(_FIELDS, start=1):
        vals = [row[i] for row in rows]
        if len(set(vals)) > 1:
            if field == "dtype":
                vals = [str(_DTYPES[v]) for v in vals]
            per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(vals))
            raise ValueError(f"moe_ep: {field} differs across ranks ({per_rank}); every rank must pass the same")
