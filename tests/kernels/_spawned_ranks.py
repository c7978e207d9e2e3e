"""Spawned ranks for the collective tests (kernels/comm, kernels/moe_ep): every rank runs
`run(rank, world, store_dir, *args)` in its own process and saves what it returns (or its traceback); the parent
gets every rank's result in rank order, or an AssertionError carrying each failed rank's traceback."""
from __future__ import annotations

import os
import traceback
import warnings
from pathlib import Path

import torch
import torch.multiprocessing as mp


def error_text(fn) -> str:
    """What a rank's bad-input call raised ("ValueError: ..."), or "no error": the parent compares them."""
    try:
        fn()
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _rank_entry(rank: int, run, world: int, store_dir: str, *args) -> None:
    try:
        torch.save(run(rank, world, store_dir, *args), os.path.join(store_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(store_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def spawn_ranks(run, world: int, store_dir: Path, *args) -> list:
    """`run` must be a module-level function of a module the spawned processes can import (tests/kernels/_*.py).
    A world in which a rank died outside Python (no rank left a traceback: gloo aborted a rank with "terminate
    called without an active exception" once on CI's 2-core machine) runs once more in a fresh store; a Python
    error in any rank, or a second such death, fails at once."""
    for attempt in (1, 2):
        run_dir = Path(store_dir) / f"attempt{attempt}"
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            mp.start_processes(_rank_entry, args=(run, world, str(run_dir), *args), nprocs=world, join=True,
                               start_method="spawn")
        except Exception as exc:
            errs = [p.read_text() for p in sorted(run_dir.glob("rank*.err"))]
            if errs or attempt == 2:
                raise AssertionError(f"a rank failed ({exc}):\n" + "\n".join(errs)) from None
            warnings.warn(f"a rank died without a Python error ({exc}); the world runs once more")
        else:
            return [torch.load(run_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


def dies_in_first_attempt(rank: int, world: int, store_dir: str, always: bool = False) -> int:
    """A rank function for the spawner's own test: rank 1 aborts (no Python traceback) in the first attempt's
    store, or in every attempt with `always`; otherwise returns its rank."""
    if rank == 1 and (always or Path(store_dir).name == "attempt1"):
        os.abort()
    return rank


def raises(rank: int, world: int, store_dir: str) -> int:
    """Rank 1 raises a Python error (the spawner must not run the world again)."""
    if rank == 1:
        raise ValueError("rank 1's bad input")
    return rank
