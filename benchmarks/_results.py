"""The header every benchmark result carries (what was measured, where, with what) and the one way to write it.

    result = {**run_header("prefix_cache", device="cpu"), ...figures...}
    write_results("prefix_cache", result)          # benchmarks/results/prefix_cache.json (or a path)

The header records the commit measured (`git rev-parse HEAD`), whether the working tree differed from it (and
which tracked files did: a dirty tree means the figures are of HEAD plus those edits), the device, the machine
(CPU, cores usable, torch threads, load average) and the versions of the packages named.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def _git(*args: str, cwd: Path = ROOT) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def git_state(cwd: Path = ROOT) -> dict:
    """{"commit", "dirty", "dirty_paths"}: HEAD and the tracked files that differ from it (untracked ones ignored).
    On the device machine the tree is a copy whose .git lags the working tree, so a call names the commit it
    measures in K3_SOURCE_COMMIT (set here, before the call: see benchmarks/device_env.sh)."""
    given = os.environ.get("K3_SOURCE_COMMIT")
    if given:
        return {"commit": given, "dirty": None, "dirty_paths": [], "commit_source": "K3_SOURCE_COMMIT"}
    changed = _git("status", "--porcelain", "--untracked-files=no", cwd=cwd)
    paths = [line[3:] for line in changed.splitlines() if line.strip()] if changed else []
    head = _git("rev-parse", "HEAD", cwd=cwd)
    return {"commit": head.strip() if head else None, "dirty": bool(paths), "dirty_paths": paths}


def machine_info() -> dict:
    import torch

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    info = {"cpu": platform.processor() or platform.machine(), "logical_cpus": os.cpu_count(), "usable_cpus": usable,
            "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
            "loadavg": list(os.getloadavg())}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def versions(*packages: str) -> dict:
    out = {"python": sys.version.split()[0]}
    for name in ("torch", "numpy", *packages):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def run_header(benchmark: str, device: str, packages: tuple[str, ...] = ()) -> dict:
    return {"benchmark": benchmark, **git_state(), "date": datetime.datetime.now().astimezone().isoformat(
        timespec="seconds"), "device": device, "machine": machine_info(), "versions": versions(*packages),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}


def write_results(name_or_path: str | Path, result: dict) -> Path:
    """Write `result` as JSON to benchmarks/results/<name>.json (a bare name) or to the path given."""
    p = Path(name_or_path)
    path = p if p.suffix == ".json" else RESULTS / f"{p}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path
