"""Spawned ranks for the collective tests (kernels/comm, kernels/moe_ep): every rank runs
`run(rank, world, store_dir, *args)` in its own process and saves what it returns (or its traceback); the parent
gets every rank's result in rank order, or an AssertionError carrying each failed rank's traceback."""
from __future__ import annotations

import os
import traceback
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
    """`run` must be a module-level function of a module the spawned processes can import (tests/kernels/_*.py)."""
    try:
        mp.start_processes(_rank_entry, args=(run, world, str(store_dir), *args), nprocs=world, join=True,
                           start_method="spawn")
    except Exception:
        errs = [p.read_text() for p in sorted(Path(store_dir).glob("rank*.err"))]
        raise AssertionError("a rank failed:\n" + "\n".join(errs))
    return [torch.load(Path(store_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]
