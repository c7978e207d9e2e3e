"""Input checks of the all-reduce, before any data moves: the local ones (a tensor, a supported dtype,
contiguous, at most MAX_DIMS dims) and, across ranks, one small all-gather of every rank's verdict, dtype and shape,
so that a mismatch or a bad tensor on one rank raises the same ValueError on every rank (a rank that raised alone
would leave its peers waiting in the collective)."""
from __future__ import annotations

import enum

import torch

from .naive import ACCUMULATOR
from .process_group import all_gather_rows

MAX_DIMS = 8
# dtypes named in mismatch messages (the index is what travels); -1 = another dtype.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2)


class Problem(enum.IntEnum):
    NONE = 0
    NOT_CONTIGUOUS = 1
    UNSUPPORTED_DTYPE = 2
    TOO_MANY_DIMS = 3


_WHY = {Problem.NOT_CONTIGUOUS: "is not contiguous", Problem.UNSUPPORTED_DTYPE:
        f"has an unsupported dtype (one of {[str(d) for d in ACCUMULATOR]})",
        Problem.TOO_MANY_DIMS: f"has more than {MAX_DIMS} dims (flatten it)"}


def local_problem(x: torch.Tensor) -> Problem:
    if x.dtype not in ACCUMULATOR:
        return Problem.UNSUPPORTED_DTYPE
    if x.dim() > MAX_DIMS:
        return Problem.TOO_MANY_DIMS
    if not x.is_contiguous():
        return Problem.NOT_CONTIGUOUS
    return Problem.NONE


def describe(x: torch.Tensor) -> str:
    return f"{x.dtype}{list(x.shape)} stride {list(x.stride())} on {x.device}"


def check_tensor(x, name: str, backend: str) -> None:
    """Checks that need no peer: raise TypeError / ValueError naming `name` (on this rank only); `backend`: the
    group's (dist.get_backend)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"all_reduce: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.device.type == "cpu" and backend == "nccl":
        raise ValueError(f"all_reduce: {name} is on the CPU but the group's backend is nccl (use a gloo group)")
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"all_reduce: {name} is on {x.device}; cpu (gloo) or cuda expected")


def raise_local(x: torch.Tensor, name: str) -> None:
    """The local problem of `x` as a ValueError / TypeError (used when the ranks are not consulted)."""
    problem = local_problem(x)
    if problem is Problem.UNSUPPORTED_DTYPE:
        raise TypeError(f"all_reduce: {name} {_WHY[problem]}: {describe(x)}")
    if problem is not Problem.NONE:
        raise ValueError(f"all_reduce: {name} {_WHY[problem]}: {describe(x)}")


def _meta(x: torch.Tensor) -> torch.Tensor:
    problem = local_problem(x)
    dims = list(x.shape)[:MAX_DIMS] if problem is not Problem.TOO_MANY_DIMS else []
    code = _DTYPES.index(x.dtype) if x.dtype in _DTYPES else -1
    row = [int(problem), code, x.dim(), *dims, *([0] * (MAX_DIMS - len(dims)))]
    return torch.tensor(row, dtype=torch.int64, device=x.device)


def _spell(row: list[int]) -> str:
    dtype = str(_DTYPES[row[1]]) if row[1] >= 0 else "another dtype"
    ndim = row[2]
    return f"{dtype}{row[3:3 + ndim]}" if ndim <= MAX_DIMS else f"{dtype} ({ndim} dims)"


def check_across_ranks(x: torch.Tensor, name: str, group) -> None:
    """Every rank of `group` calls this with its `x`; all raise the same error if any rank's `x` is bad or the
    dtypes / shapes differ. One all-gather of 3 + MAX_DIMS int64 per rank."""
    mine = _meta(x)
    rows = all_gather_rows(mine, group).cpu().tolist()
    for problem in (Problem.UNSUPPORTED_DTYPE, Problem.TOO_MANY_DIMS, Problem.NOT_CONTIGUOUS):
        bad = [r for r, row in enumerate(rows) if row[0] == problem]
        if bad:
            error = TypeError if problem is Problem.UNSUPPORTED_DTYPE else ValueError
            here = f" (here: {describe(x)})" if local_problem(x) is problem else ""
            raise error(f"all_reduce: {name} {_WHY[problem]} on rank(s) {bad} of the group{here}")
    spelled = [_spell(row) for row in rows]
    if len(set(spelled)) > 1:
        per_rank = ", ".join(f"rank {r}: {s}" for r, s in enumerate(spelled))
        raise ValueError(f"all_reduce: {name} differs across ranks ({per_rank}); every rank must pass the same "
                         f"dtype and shape")
