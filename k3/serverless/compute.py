"""Multi-session compute over one base model: rows of many sessions in one forward (and backward), each row
through its own session's adapter (`k3.lora.LoRAManager` per-token selection: the segment-grouped LoRA matmuls).

A session's result does not depend on who shares the call, bit for bit:
  * rows are padded to a length bucket that depends on the row alone (`bucket_len`): a row is always computed at
    the same length (attention and KDA reductions over a different padded length round differently);
  * padding positions select no adapter (slot -1), so an adapter's matmuls see exactly its session's tokens, in
    the same order, whoever else is in the batch;
  * each session's loss is computed on its own rows only (`k3.serverless.losses`), bucket by bucket in ascending
    order, and its gradient accumulates in that order.
tests/serverless/test_compute.py checks a mixed call against each session run alone (losses, log-probs,
gradients, bitwise)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from k3.lora import LoRAManager
from k3.serverless.losses import LossConfig, session_loss
from k3.serverless.types import Datum


def bucket_len(n: int, bucket: int) -> int:
    return -(-n // bucket) * bucket


@dataclass
class Work:
    """One session's part of a packed call: its adapter's name in the manager, its data and loss."""
    adapter: str
    data: list[Datum]
    loss_fn: str
    loss_config: LossConfig = field(default_factory=LossConfig)


@dataclass
class WorkResult:
    logprobs: list[list[float]]
    metrics: dict[str, float]


def _row_inputs(d: Datum, L: int) -> dict[str, torch.Tensor]:
    n = d.model_input.length
    out = {}
    for name, default in (("target_tokens", 0), ("weights", 1.0), ("logprobs", 0.0), ("advantages", 0.0),
                          ("logprob_grads", 0.0)):
        v = d.loss_fn_inputs.get(name)
        t = torch.zeros(L, dtype=torch.long if name == "target_tokens" else torch.float32)
        t[:n] = torch.tensor(v, dtype=t.dtype) if v is not None else default
        out[name] = t
    return out


def run_packed(model: nn.Module, manager: LoRAManager, works: list[Work], *, bucket: int, backward: bool
               ) -> list[WorkResult]:
    """Forward (and, with `backward`, accumulate gradients into each session's adapter) for all `works` at once.
    Inputs must already be validated (ids in the vocabulary, required loss inputs present)."""
    rows = [(wi, di, d, bucket_len(d.model_input.length, bucket)) for wi, w in enumerate(works)
            for di, d in enumerate(w.data)]
    logprobs: list[list[list[float] | None]] = [[None] * len(w.data) for w in works]
    metrics: list[dict[str, float]] = [{} for _ in works]
    for L in sorted({r[3] for r in rows}):
        group = [r for r in rows if r[3] == L]
        ids = torch.zeros(len(group), L, dtype=torch.long)
        slots = torch.full((len(group), L), -1, dtype=torch.long)
        per = [_row_inputs(d, L) for wi, _, d, _ in group]
        for i, (wi, _, d, _) in enumerate(group):
            n = d.model_input.length
            ids[i, :n] = torch.tensor(d.model_input.tokens)
            slots[i, :n] = manager.slot(works[wi].adapter)
        device = next(model.parameters()).device
        ids, slots = ids.to(device), slots.to(device)
        routed = _routed(model, [d for _, _, d, _ in group], L)
        with torch.set_grad_enabled(backward), manager.use(slots):
            logits = model(ids, use_cache=False,
                           routed_experts=None if routed is None else routed.to(device)).logits.float()
            tgt = torch.stack([p["target_tokens"] for p in per]).to(device)
            lp = logits.gather(-1, tgt[..., None])[..., 0] - torch.logsumexp(logits, dim=-1)
            total = None
            for wi in sorted({g[0] for g in group}):
                idx = [i for i, g in enumerate(group) if g[0] == wi]
                sel = torch.tensor(idx, device=device)
                inputs = {k: torch.stack([per[i][k] for i in idx]).to(device)
                          for k in ("weights", "logprobs", "advantages", "logprob_grads")}
                loss, m = session_loss(works[wi].loss_fn, lp.index_select(0, sel), inputs, works[wi].loss_config)
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"adapter {works[wi].adapter}: loss is {float(loss)}")
                for k, v in m.items():
                    metrics[wi][k] = metrics[wi].get(k, 0.0) + float(v)
                total = loss if total is None else total + loss
            if backward and total is not None and total.requires_grad:
                total.backward()
        lpd = lp.detach().cpu()
        for i, (wi, di, d, _) in enumerate(group):
            logprobs[wi][di] = lpd[i, : d.model_input.length].tolist()
    return [WorkResult(lps, m) for lps, m in zip(logprobs, metrics)]


def _routed(model: nn.Module, data: list[Datum], L: int) -> torch.Tensor | None:
    """Router Replay for one bucket: [B, L, n_moe, k] expert ids from the data's `routed_experts` (-1 = route
    freely: rows without it, padding); None when no datum carries any (the routing is then the router's own,
    and -1 everywhere would give the same bits)."""
    if not any("routed_experts" in d.loss_fn_inputs for d in data):
        return None
    cfg = model.config
    out = torch.full((len(data), L, len(cfg.moe_layer_ids), cfg.num_experts_per_token), -1, dtype=torch.long)
    for i, d in enumerate(data):
        r = d.loss_fn_inputs.get("routed_experts")
        if r is not None:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


@torch.no_grad()
def prompt_logprobs(model: nn.Module, manager: LoRAManager, items: list[tuple[str, list[int]]], *, bucket: int
                    ) -> list[list[float | None]]:
    """log p(token_i | tokens_<i) for each (adapter, tokens): the first entry is None (nothing predicts it).
    No gradient: the model's batch-invariant inference path, so the result does not depend on the batch."""
    res: dict[int, list[float | None]] = {}
    groups: dict[int, list[int]] = {}
    for i, (_, t) in enumerate(items):
        groups.setdefault(bucket_len(len(t), bucket), []).append(i)
    device = next(model.parameters()).device
    for L in sorted(groups):
        idx = groups[L]
        ids = torch.zeros(len(idx), L, dtype=torch.long)
        slots = torch.full((len(idx), L), -1, dtype=torch.long)
        for r, i in enumerate(idx):
            a, t = items[i]
            ids[r, : len(t)] = torch.tensor(t)
            if a is not None:
                slots[r, : len(t)] = manager.slot(a)
        with manager.use(slots.to(device)):
            logits = model(ids.to(device), use_cache=False).logits.float()
        lp = (logits[:, :-1].gather(-1, ids[:, 1:, None].to(device))[..., 0]
              - torch.logsumexp(logits[:, :-1], dim=-1)).cpu()
        for r, i in enumerate(idx):
            n = len(items[i][1])
            res[i] = [None] + lp[r, : n - 1].tolist()
    return [res[i] for i in range(len(items))]
