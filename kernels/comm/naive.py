"""The spec of the deterministic all-reduce: the element-wise sum over ranks in rank order 0, 1, ..., W-1,
accumulated in fp32 (bf16 / fp16 inputs are widened first) and rounded once to the input dtype.

Every implementation (the process-group path, one-shot and two-shot over symmetric memory, on CPU or CUDA) must
return exactly these bits, on every rank and every run: floating-point addition is not associative, so a sum whose
order depends on the algorithm, the message size or the arrival order of peers (NCCL's ring and tree do) gives
different bits on different runs or ranks, and the trainer's replicas drift apart."""
from __future__ import annotations

from collections.abc import Sequence

import torch

# dtypes the library reduces; the sum of each is accumulated in ACCUMULATOR[dtype].
ACCUMULATOR = {torch.float32: torch.float32, torch.bfloat16: torch.float32, torch.float16: torch.float32}


def ordered_sum(parts: Sequence[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """parts[0] + parts[1] + ... + parts[-1] element-wise, left to right in the accumulator dtype, rounded once
    to `out_dtype`. `parts` are equal-shaped tensors (one per rank, in rank order)."""
    acc = parts[0].to(ACCUMULATOR[out_dtype], copy=True)
    for p in parts[1:]:
        acc += p.to(acc.dtype)
    return acc.to(out_dtype)


def naive_all_reduce(per_rank: Sequence[torch.Tensor]) -> torch.Tensor:
    """What every rank must receive when rank r contributes per_rank[r] (the spec, in one process)."""
    if not per_rank:
        raise ValueError("naive_all_reduce: per_rank is empty (one tensor per rank expected)")
    first = per_rank[0]
    if first.dtype not in ACCUMULATOR:
        raise TypeError(f"naive_all_reduce: dtype {first.dtype} not supported (one of {list(ACCUMULATOR)})")
    for r, t in enumerate(per_rank):
        if t.shape != first.shape or t.dtype != first.dtype:
            raise ValueError(f"naive_all_reduce: per_rank[{r}] is {t.dtype}{list(t.shape)}, "
                             f"per_rank[0] is {first.dtype}{list(first.shape)}")
    return ordered_sum(list(per_rank), first.dtype)
