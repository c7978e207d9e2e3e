"""Offline sm_90a build of the KDA forward intra kernel (`_fwd_intra`), no GPU needed: registers, spills, shared
memory and a histogram of the SASS instructions, for one or more code versions (directories holding a `kernels/`
tree, as for benchmarks/kda_ab.py). Static counts, not timings: they say what a change did to the code, the GPU says what it cost.

`python -m benchmarks.kda_sass main=. NAME=.ab/NAME`, each version built in its own process. The launch is
the benchmark's (bf16 inputs, K = V = 128, K slices of 32, the version's CONFIG warps / stages / register cap, TF32
dots, no saving for backward), with the 16-byte divisibility hints the runtime gives these arguments: without them loads compile to scalar ones and
the figures are not the runtime's.
"""
from __future__ import annotations

import collections
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from benchmarks.kda_ab import run_in_version

ARG_TYPES = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "beta": "*bf16", "Gc": "*fp32", "Aqk": "*bf16",
             "Kkk": "*fp32", "Mc": "*fp32", "Wc": "*bf16", "Uc": "*bf16", "QGc": "*bf16", "KDc": "*bf16",
             "cu": "*i64", "cidx": "*i32", "c_first": "i32", "scale": "fp32", "H": "i32", "HV": "i32", "K": "i32",
             "V": "i32"}
CONSTEXPRS = dict(BK=128, BKS=32, BVF=128, BVS=32, SAVE=False, PREC="tf32", FAST=True)
TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _worker() -> dict:
    """Build `_fwd_intra` of the `k3_kernels` on the path (benchmarks.kda_ab.run_in_version's): one build, or one
    per value of its `WHOLE` switch (whole-chunk dots / 16-row blocks) in versions that have it."""
    mod = importlib.import_module("k3_kernels.kda.chunk")
    fn, cfg = mod._fwd_intra, mod.CONFIG
    options = dict(num_warps=cfg.get("intra_warps", 4), num_stages=cfg.get("intra_stages", 3),
                   **({"maxnreg": cfg["intra_maxnreg"]} if cfg.get("intra_maxnreg") else {}))
    if "WHOLE" not in fn.arg_names:
        return {"": _build(fn, CONSTEXPRS, options)}
    whole = dict(num_warps=cfg.get("intra_whole_warps", options["num_warps"]),
                 num_stages=cfg.get("intra_whole_stages", options["num_stages"]),
                 **({"maxnreg": cfg["intra_whole_maxnreg"]} if cfg.get("intra_whole_maxnreg") else {}))
    return {f"WHOLE={w}": _build(fn, dict(CONSTEXPRS, WHOLE=w), whole if w else options) for w in (True, False)}


def _build(fn, constexprs: dict, options: dict) -> dict:
    """Registers, spills, shared memory and SASS histogram of one sm_90a build of fn with the launch's options
    (warps, stages, register cap)."""
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name], consts[(i,)] = "constexpr", constexprs[name]
        else:
            sig[name] = ARG_TYPES[name]
            if name != "scale":
                attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                            options=options)
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        info = subprocess.run([os.path.join(TOOLS, "ptxas"), "-v", "--gpu-name", "sm_90a", ptx, "-o",
                               os.path.join(d, "x.cubin")], capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([os.path.join(TOOLS, "cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    ops = collections.Counter(m.group(1) for m in re.finditer(
        r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass, re.M))
    num = lambda pattern: int(re.search(pattern, info).group(1))  # noqa: E731
    return dict(registers=num(r"Used (\d+) registers"), spill_stores_B=num(r"(\d+) bytes spill stores"),
                spill_loads_B=num(r"(\d+) bytes spill loads"), shared_B=kernel.metadata.shared,
                instructions=sum(ops.values()), top=dict(ops.most_common(20)))


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        print(json.dumps(_worker()))
        return
    versions = [a.split("=", 1) for a in sys.argv[1:]]
    if not versions or any(len(v) != 2 for v in versions):
        raise SystemExit("usage: python -m benchmarks.kda_sass NAME=DIR [NAME=DIR ...]")
    for name, path in versions:
        builds = run_in_version(path, "benchmarks.kda_sass")
        if "error" in builds:
            raise SystemExit(f"{name}: build failed\n{builds['error']}")
        for variant, r in builds.items():
            print(f"{name}{f' [{variant}]' if variant else ''}: {r['registers']} registers, spills "
                  f"{r['spill_stores_B']} B stored / {r['spill_loads_B']} B loaded, {r['shared_B']} B shared, "
                  f"{r['instructions']} SASS instructions")
            print("   ", ", ".join(f"{op} {n}" for op, n in r["top"].items()))


if __name__ == "__main__":
    main()
