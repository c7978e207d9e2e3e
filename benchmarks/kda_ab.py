"""A/B of our chunk_kda across code versions on one GPU: each version's `k3_kernels` in a process of its own.

A version is a directory holding a `kernels/` tree, e.g. a branch exported with
`mkdir -p .ab/NAME && git archive BRANCH kernels | tar -x -C .ab/NAME` (ignore `.ab/` in `.git/info/exclude` and
name it in the device call's `carry`). `python -m benchmarks.kda_ab main=. NAME=.ab/NAME [--repeat 2]` runs the
versions in turn (A B A B with --repeat 2) and times ours only, the inputs of benchmarks/kda.py: forward (no_grad)
and forward+backward medians at 16K with the benchmark's gate, with a sharp safe-gate decay (g = -5 sigmoid(x):
every chunk spans more than 80) pre-computed (`16K_safe_gate`) and applied by the kernels (`16K_gate_in_kernel`,
benchmarks.kda.sharp_safe_gate: the gate's backward included), and on the packed batch; forward on 32 packed
sequences (`varlen_many`), 64K and 128K; device time per kernel in one 16K forward+backward
(benchmarks.kda.breakdown); and the relative RMS error of o and every gradient against the fp64 recurrent
reference at T=512. `--rows varlen,16K` times those rows
only (a shorter run per version: more versions fit in one device call); a row may also be one of benchmarks/kda.py's
named rows (`16K_k3init_H96`, `64K_sharp_H16`, `varlen_k3init_H16`, ...: its inputs, gate and head count).
`--breakdown ROW` profiles that row instead of the 16K k3init one, `--breakdown none` skips the profile.
`NAME=DIR+key=value+...` runs DIR's code
with those entries of its `k3_kernels.kda.chunk.CONFIG` set (Python literals:
`p64=.ab/x+fwd_state_piece_chunks=64+fwd_state_rest_bv=None`), so launch settings need no copy of the tree.
Versions differ in code or settings only, so the numbers are comparable within one call; the fla-core comparison
is benchmarks/kda.py's. Writes kda_ab.json to $OUT or benchmarks/results/.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tempfile

import torch

from benchmarks._results import run_header
from benchmarks.kda import ROWS as BENCH_ROWS
from benchmarks.kda import breakdown_rows

ROWS = {"16K": 16384, "16K_safe_gate": 16384, "16K_gate_in_kernel": 16384, "varlen": 32768, "varlen_many": 65536,
        "64K": 65536, "128K": 131072}  # row -> tokens


def many_cu_seqlens() -> torch.Tensor:
    """The `varlen_many` row's batch, a guard for packing changes tuned on the benchmark's 8-sequence batch: 32
    sequences with log-uniform lengths in [128, 8192] (several long ones, as in RL rollouts), scaled to 65536
    tokens (on the host)."""
    gen = torch.Generator().manual_seed(2)
    lengths = torch.exp(torch.empty(32).uniform_(0, 6, generator=gen)) * 128
    cuts = torch.cumsum(lengths / lengths.sum() * 65536, 0).round().long()
    return torch.cat([torch.tensor([0]), cuts[:-1], torch.tensor([65536])])


def known_row(row: str) -> bool:
    """A row of ROWS or one of benchmarks/kda.py's named rows."""
    return row in ROWS or row in BENCH_ROWS


def _named_row(row: str) -> tuple[list, list, dict, int, torch.Tensor]:
    """(inputs, gradient leaves, chunk_kda keywords, T, upstream gradient) of a benchmarks/kda.py named row."""
    from benchmarks.kda import row_inputs, row_kwargs
    xs, do, cu, params, T, _ = row_inputs(row)
    return xs, xs + list(params or ()), row_kwargs(cu, params), T, do


def _time_version(rows: list[str], config: dict, profile: str | None = "16K_k3init_H16") -> dict:
    """Worker: timings and errors of the `k3_kernels` first on the path with `config` set in its CONFIG, for the
    named rows (ROWS, or benchmarks/kda.py's), and the device time per kernel of row `profile` (None: none)."""
    from benchmarks.kda import (D, H, breakdown, dev, inputs, packed_cu_seqlens, rel, safe_gate_kwargs,
                                sharp_safe_gate)
    from k3_kernels.kda import chunk as chunk_mod
    from k3_kernels.kda import chunk_kda, naive_recurrent_kda

    unknown = sorted(set(config) - set(chunk_mod.CONFIG))
    if unknown:
        raise SystemExit(f"CONFIG has no key(s) {unknown} in this version")
    chunk_mod.CONFIG.update(config)

    out = {}
    for row in rows:
        if row not in ROWS:  # one of benchmarks/kda.py's named rows
            xs, leaves, kw, T, do = _named_row(row)
            _time_row(out, row, xs, leaves, kw, T, do)
            del xs, leaves, do
            torch.cuda.empty_cache()
            continue
        T = ROWS[row]
        xs = inputs(T)
        kw, leaves = {}, xs
        if row == "16K_safe_gate":  # the decay of `sharp_safe_gate` (A_log = dt_bias = 0), pre-computed
            with torch.no_grad():
                xs[3].copy_(-5 * torch.sigmoid(sharp_safe_gate(T)[0]))
        if row == "16K_gate_in_kernel":  # the same decay, applied by the kernels (and its backward)
            xs[3], A_log, dt_bias = sharp_safe_gate(T)
            kw = safe_gate_kwargs(A_log, dt_bias)
            leaves = xs + [A_log, dt_bias]
        if row.startswith("varlen"):  # with the host copy of cu_seqlens: no device sync per call
            cu = (packed_cu_seqlens() if row == "varlen" else many_cu_seqlens()).to(dev)
            kw = dict(cu_seqlens=cu, cu_seqlens_cpu=cu.cpu())
        do = torch.randn(1, T, H, D, device=dev, dtype=torch.bfloat16) if T <= 32768 else None
        _time_row(out, row, xs, leaves, kw, T, do)
        del xs, leaves, do
        torch.cuda.empty_cache()
    if profile is not None:
        out[f"breakdown_{profile}_fwdbwd_ms"] = breakdown(row=profile)
    xs = inputs(512, seed=1)
    do = torch.randn(1, 512, H, D, device=dev, dtype=torch.bfloat16)
    o = chunk_kda(*xs)[0]
    ours = [o] + list(torch.autograd.grad(o, xs, do))
    ref_in = [x.detach().double().requires_grad_(True) for x in xs]
    o_ref = naive_recurrent_kda(*ref_in)[0]
    refs = [o_ref] + list(torch.autograd.grad(o_ref, ref_in, do.double()))
    out["rel_rms_vs_fp64_T512"] = {n: rel(a, b) for n, a, b in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), ours, refs)}
    return out


def _time_row(out: dict, row: str, xs: list, leaves: list, kw: dict, T: int, do: torch.Tensor | None) -> None:
    """`row`'s forward (no_grad) median into out, and with an upstream gradient `do` (rows up to 32K) its
    forward+backward."""
    from benchmarks.kda import med
    from k3_kernels.kda import chunk_kda
    with torch.no_grad():
        chunk_kda(*xs, **kw)
        out[f"{row}_fwd_ms"] = med(lambda: chunk_kda(*xs, **kw), rep=100 if T <= 32768 else 30)
    if do is not None and T <= 32768:
        def fwd_bwd():
            chunk_kda(*xs, **kw)[0].backward(do)
        fwd_bwd()
        out[f"{row}_fwdbwd_ms"] = med(fwd_bwd, rep=50, grad_to_none=leaves)


def _kernels_of(version_dir: str) -> str:
    kernels = os.path.join(os.path.abspath(version_dir), "kernels")
    if not os.path.isdir(kernels):
        raise SystemExit(f"version directory {version_dir!r} has no kernels/ tree")
    return kernels


def run_in_version(version_dir: str, module: str, args: tuple[str, ...] = ()) -> dict:
    """`python -m module --worker *args` in a fresh process whose `k3_kernels` is version_dir/kernels (one version
    per process: Triton's jit caches are per function object); the worker prints a JSON dict as its last line.
    TRITON_INTERPRET is dropped: versions are compared as the GPU builds them."""
    kernels = _kernels_of(version_dir)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as link_dir:
        os.symlink(kernels, os.path.join(link_dir, "k3_kernels"))
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join([link_dir, repo, os.environ.get("PYTHONPATH", "")])
        proc = subprocess.run([sys.executable, "-m", module, "--worker", *args], cwd=repo, env=env,
                              capture_output=True, text=True)
    if proc.returncode:
        return {"error": proc.stderr[-3000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _option(name: str, default: str | None = None) -> str | None:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def _version(arg: str) -> tuple[str, str, dict]:
    """`NAME=DIR+key=value+...` -> (name, directory, CONFIG entries); values are Python literals."""
    name, spec = arg.split("=", 1)
    path, *settings = spec.split("+")
    config = {}
    for setting in settings:
        key, sep, value = setting.partition("=")
        try:
            config[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            sep = ""
        if not sep or not key:
            raise SystemExit(f"version {name!r}: setting {setting!r} is not key=<Python literal>")
    return name, path, config


def main() -> None:
    rows = _option("--rows", ",".join(ROWS)).split(",")
    unknown = [r for r in rows if not known_row(r)]
    if unknown:
        raise SystemExit(f"--rows: unknown row(s) {unknown}; rows are {list(ROWS)} or benchmarks/kda.py's named rows")
    profile = _option("--breakdown", "16K_k3init_H16")
    profile = None if profile == "none" else breakdown_rows(["--breakdown", profile])[0]
    if "--worker" in sys.argv:
        print(json.dumps(_time_version(rows, json.loads(_option("--config", "{}")), profile)))
        return
    repeat = int(_option("--repeat", "1"))
    versions = [_version(a) for a in sys.argv[1:] if "=" in a]
    if not versions:
        raise SystemExit("usage: python -m benchmarks.kda_ab NAME=DIR[+key=value...] [NAME=DIR ...] [--repeat N] "
                         "[--rows a,b]")
    for _, path, _ in versions:  # all checked before the first (long) run
        _kernels_of(path)
    res = {**run_header("kda_ab", torch.cuda.get_device_name(), ("torch", "triton")), "runs": []}
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out_dir, exist_ok=True)
    for rep in range(repeat):
        for name, path, config in versions:
            timed = run_in_version(path, "benchmarks.kda_ab", ("--rows", ",".join(rows), "--config",
                                                                json.dumps(config), "--breakdown", profile or "none"))
            res["runs"].append(dict(version=name, repeat=rep, config=config, **timed))
            print(json.dumps(res["runs"][-1]), flush=True)
            with open(os.path.join(out_dir, "kda_ab.json"), "w") as f:  # after every run: a cut call keeps them
                json.dump(res, f, indent=1)
    print(f"\n{'version':>24} " + " ".join(f"{r + ' fwd':>18}" for r in rows))
    for run in res["runs"]:
        print(f"{run['version']:>24} " + " ".join(f"{run.get(r + '_fwd_ms', float('nan')):>18.4f}" for r in rows))


if __name__ == "__main__":
    main()
