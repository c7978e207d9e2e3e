"""The main job as a user runs it: `make demo` from a fresh clone, timed, its peak memory and its summary recorded.

1. `git clone` of this repository's HEAD into a temporary directory (uncommitted edits are not measured; the
   launch tree's state is recorded beside the commit measured);
2. `make .venv/.installed` there (virtual environment + torch + the package: the install part of `make demo`), then
   `make demo` (now only the job: SFT warm start from scratch, then the RL updates), each timed by wall clock; the
   two together are what one `make demo` in a fresh clone runs;
3. peak RSS: `getrusage(RUSAGE_CHILDREN).ru_maxrss` after each phase (the largest resident set of any process
   waited for so far: after the install, of pip; after the job, of whichever was larger), and the job's own
   `peak_rss_bytes` from its summary.json (SFT and RL run in one process);
4. writes benchmarks/results/main_job_cpu.json: commit, the wall times, peak RSS, the job's summary.json (summary
   and config) and metrics.jsonl rows, the machine and the versions inside the clone's environment.

Quick checks (NOT `make demo`; written to runs/main_job_check.json unless --out says otherwise):
  --reuse-venv PATH  skip the install: run the job with PATH's interpreter on the clone's code (PYTHONPATH);
  --updates N, --set SECTION.FIELD=VALUE  passed to `k3 rl` (e.g. --updates 1 --set sft.steps=5 --set eval.heldout=2).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._results import ROOT, RESULTS, git_state, machine_info, run_header, write_results

DEMO_OUT = "runs/demo"


def demo_command(clone: Path, venv: str) -> list[str]:
    """The job line of the Makefile's `demo` recipe, $(VENV) replaced (kept in step with the Makefile)."""
    lines = (clone / "Makefile").read_text().splitlines()
    i = next(i for i, line in enumerate(lines) if re.match(r"^demo\s*:", line))
    recipe = lines[i + 1]
    if not recipe.startswith("\t") or f"--out {DEMO_OUT}" not in recipe:
        raise SystemExit(f"Makefile: the demo recipe changed ({recipe.strip()!r}); update benchmarks/main_job.py")
    return recipe.strip().replace("$(VENV)", venv).split()


def peak_rss_children() -> int:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux


def timed(cmd: list[str], cwd: Path, env: dict, log: Path) -> dict:
    """Run `cmd` (output to `log`), its wall time and the children's peak RSS so far."""
    print(f"$ {' '.join(cmd)}  (in {cwd}; output in {log})", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)}: exit status {proc.returncode}\n{log.read_text()[-4000:]}")
    return {"command": " ".join(cmd), "wall_s": wall, "rc": proc.returncode,
            "peak_rss_children_bytes_so_far": peak_rss_children()}


def clone_env_versions(python: str, env: dict, clone: Path) -> dict:
    """Versions inside the job's environment, and where its `k3` came from (the clone's, checked)."""
    code = ("import json, sys, torch, numpy, k3; print(json.dumps({'python': sys.version.split()[0], "
            "'torch': torch.__version__, 'numpy': numpy.__version__, 'k3_from': k3.__file__}))")
    got = json.loads(subprocess.run([python, "-c", code], cwd=clone, env=env, capture_output=True, text=True,
                                    check=True).stdout)
    if not Path(got["k3_from"]).resolve().is_relative_to(clone.resolve()):
        raise SystemExit(f"the job's environment imports k3 from {got['k3_from']}, not from the clone {clone}")
    return got


def reuse_env(clone: Path, venv: Path, shim: Path) -> dict:
    """Environment running `venv`'s interpreter on the clone's code: the clone first on sys.path, and a shim
    directory mapping the editable install's renamed packages (k3_kernels = kernels/, k3_verl) to the clone."""
    shim.mkdir(exist_ok=True)
    for name, rel in (("k3_kernels", "kernels"), ("k3_verl", "plugins/verl_k3")):
        if (clone / rel).exists():
            (shim / name).symlink_to(clone / rel)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(clone), str(shim)])
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    return env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reuse-venv", default=None, help="quick check: skip the install, use this venv")
    ap.add_argument("--updates", type=int, default=None, help="quick check: `k3 rl --updates N`")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="quick check")
    ap.add_argument("--keep", action="store_true", help="keep the temporary clone (printed)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    exact = args.reuse_venv is None and args.updates is None and not args.set
    out = args.out or (RESULTS / "main_job_cpu.json" if exact else ROOT / "runs" / "main_job_check.json")
    launch = git_state()
    tmp = Path(tempfile.mkdtemp(prefix="k3-main-job-"))
    clone = tmp / "k3-plugins"
    try:
        t_all = time.perf_counter()
        subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
        measured = git_state(clone)
        phases = {}
        if args.reuse_venv is None:
            env = dict(os.environ)
            phases["install"] = timed(["make", ".venv/.installed"], clone, env, tmp / "install.log")
            python = str(clone / ".venv" / "bin" / "python")
        else:
            venv = Path(args.reuse_venv).resolve()
            env = reuse_env(clone, venv, tmp / "shim")
            python = str(venv / "bin" / "python")
        if exact:
            phases["job"] = timed(["make", "demo"], clone, env, tmp / "job.log")
        else:
            cmd = demo_command(clone, ".venv" if args.reuse_venv is None else str(Path(args.reuse_venv).resolve()))
            cmd += (["--updates", str(args.updates)] if args.updates is not None else [])
            cmd += [x for s in args.set for x in ("--set", s)]
            phases["job"] = timed(cmd, clone, env, tmp / "job.log")
        total = time.perf_counter() - t_all
        saved = json.loads((clone / DEMO_OUT / "summary.json").read_text())
        rows = [json.loads(line) for line in (clone / DEMO_OUT / "metrics.jsonl").read_text().splitlines()]
        job_versions = clone_env_versions(python, env, clone)
        with open("/proc/meminfo") as f:
            mem_total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal"))
        install_s = phases.get("install", {}).get("wall_s")
        result = {
            **run_header("main_job", device="cpu"), **measured,
            "measured": "fresh git clone of the commit above" + ("" if exact else " (quick check, NOT make demo)"),
            "exact_make_demo": exact, "launch_tree": launch,
            "timing": {"install_wall_s": install_s, "job_wall_s": phases["job"]["wall_s"],
                       "make_demo_wall_s": (install_s + phases["job"]["wall_s"]) if install_s is not None else None,
                       "clone_install_job_wall_s": total, "rl_wall_s": saved["summary"].get("wall_s"),
                       "sft_and_setup_wall_s": phases["job"]["wall_s"] - saved["summary"].get("wall_s", 0.0)},
            "peak_rss": {"children_after_install_bytes": phases.get("install", {}).get(
                             "peak_rss_children_bytes_so_far"),
                         "children_after_job_bytes": phases["job"]["peak_rss_children_bytes_so_far"],
                         "job_process_bytes": saved["summary"].get("peak_rss_bytes")},
            "phases": phases,
            "machine": {**machine_info(), "mem_total_bytes": mem_total,
                        "K3_CPU_THREADS": os.environ.get("K3_CPU_THREADS")},
            "job_versions": job_versions,
            "summary": saved["summary"], "config": saved["config"], "metrics": rows,
        }
        path = write_results(out, result)
        t = result["timing"]
        rss = result["peak_rss"]["children_after_job_bytes"]
        print(f"\ncommit {measured['commit'][:12]} ({'make demo' if exact else 'quick check'}): "
              f"install {t['install_wall_s'] or 0:.0f} s, job {t['job_wall_s']:.0f} s (RL {t['rl_wall_s']:.0f} s), "
              f"peak RSS {rss / 1e9:.2f} GB; held-out {saved['summary']['base_heldout_reward']:.3f} -> "
              f"{saved['summary']['final_heldout_reward']:.3f}\nwrote {path}")
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
