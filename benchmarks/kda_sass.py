"""Offline sm_90a build of the KDA forward intra kernel (`_fwd_intra`), no GPU needed: registers, spills, shared
memory and a histogram of the SASS instructions, for one or more code versions (directories holding a `kernels/`
tree, as for benchmarks/kda_ab.py). Static counts, not timings: they say what a change did to the code, the GPU says what it cost.

`python -m benchmarks.kda_sass main=. NAME=.ab/NAME`, each version built in its own process. The launch is
the benchmark's (bf16 inputs, K = V = 128, K slices of 32, the version's CONFIG warps / stages / register cap, TF32
dots, no saving for backward), with the 16-byte divisibility hints the runtime gives these arguments: without them loads compile to scalar ones and
the figures are not the runtime's.
`--all`: instead, every chunked-KDA kernel and the decode kernel at the benchmark's launches (bf16, K = V = 128; the
gate in the cumsum kernel off and on; state passes at V blocks 16 and 64; both intra launches), each version's SASS
instruction stream hashed with its symbol names removed: equal hashes mean the versions build the same machine code
(a refactor's check that the measured rows cannot have moved).
"""
from __future__ import annotations

import collections
import hashlib
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
             "gated_kk": "*fp32", "Kkk": "*fp32", "Mc": "*fp32", "Wc": "*bf16", "Uc": "*bf16", "QGc": "*bf16",
             "KDc": "*bf16", "cu": "*i64", "cidx": "*i32", "c_first": "i32", "scale": "fp32", "H": "i32", "HV": "i32",
             "K": "i32", "V": "i32"}
CONSTEXPRS = dict(BK=128, BKS=32, BVF=128, BVS=32, SAVE=False, PREC="tf32", FAST=True)
TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _worker() -> dict:
    """Build `_fwd_intra` of the `k3_kernels` on the path (benchmarks.kda_ab.run_in_version's): one build, or one
    per value of its `WHOLE` switch (whole-chunk dots / 16-row blocks) in versions that have it."""
    mod = importlib.import_module("k3_kernels.kda.chunk")
    try:  # since the FLA-style split the kernel lives in chunk_intra.py
        fn = importlib.import_module("k3_kernels.kda.chunk_intra")._fwd_intra
    except ImportError:
        fn = mod._fwd_intra
    cfg = mod.CONFIG
    options = dict(num_warps=cfg.get("intra_warps", 4), num_stages=cfg.get("intra_stages", 3),
                   **({"maxnreg": cfg["intra_maxnreg"]} if cfg.get("intra_maxnreg") else {}))
    if "WHOLE" not in fn.arg_names:
        return {"": _build(fn, CONSTEXPRS, options)}
    whole = dict(num_warps=cfg.get("intra_whole_warps", options["num_warps"]),
                 num_stages=cfg.get("intra_whole_stages", options["num_stages"]),
                 **({"maxnreg": cfg["intra_whole_maxnreg"]} if cfg.get("intra_whole_maxnreg") else {}))
    return {f"WHOLE={w}": _build(fn, dict(CONSTEXPRS, WHOLE=w), whole if w else options) for w in (True, False)}


# ("Kkk": gated_kk's name before session 35, for builds of older versions)
ALL_TYPES = {"g": "*fp32", "A_log": "*fp32", "dt_bias": "*fp32", "Gc": "*fp32", "gated_kk": "*fp32", "Kkk": "*fp32",
             "Mc": "*fp32", "Rs": "*fp32", "Ps": "*fp32", "DQs": "*fp32", "DKs": "*fp32", "DGs": "*fp32", "dg": "*fp32",
             "h0": "*fp32", "ht": "*fp32", "dht": "*fp32", "dh0": "*fp32", "cu": "*i64", "cidx": "*i32",
             "coff": "*i32", "seqs": "*i32", "idx": "*i64", "c_first": "i32", "t_lo": "i32", "t_hi": "i32",
             "h0_row": "i32", "ht_row": "i32", "dht_row": "i32", "dh0_row": "i32", "scale": "fp32",
             "lower_bound": "fp32",
             "H": "i32", "HV": "i32", "K": "i32", "V": "i32", "T": "i32", "P": "i32", "dG": "*fp32",
             "part_dt": "*fp32", "part_A": "*fp32", "n_tok": "i32", "eps": "fp32", "g_out": "*fp32",
             "beta_out": "*fp32", "roll": "*i64", **{s: "i32" for s in ("sx_b", "sx_t", "sf_b", "sf_t", "sb_b", "sb_t",
                                                                    "sw_b", "sw_s", "sw_c", "sw_j")}}  # other pointers: bf16
_STATE = dict(HV=16, K=128, V=128, BK=128, BVF=128, PREC="tf32")
# the decode kernel's constexprs (BETA_SIGMOID: BETA_LOGIT_SCALE's name before session 35, for older versions)
_RECURRENT = dict(H=16, HV=16, K=128, V=128, BK=128, BV=32, GATE=2, HAS_A=True, HAS_DT=True, L2NORM=False,
                  HAS_H0=True, STORE_HT=True, VARLEN=False, HAS_IDX=False, BETA_SIGMOID=0, BETA_LOGIT_SCALE=0,
                  STATE_V_FIRST=False, STAGES=2, PREFETCH_QK=True)
ALL_CASES = {  # name: (kernel, constexprs (those the version's kernel takes), options)
    "cumsum": ("_fwd_cumsum", dict(BK=128, KA=32, GATE=0, HAS_A=False, HAS_DT=False), dict(num_warps=4)),
    "cumsum_safe_gate": ("_fwd_cumsum", dict(BK=128, KA=32, GATE=2, HAS_A=True, HAS_DT=True), dict(num_warps=4)),
    "fwd_state_bv16": ("_fwd_state", dict(_STATE, BV=16, HAS_H0=False, STORE_HT=False, SAVE=True, NUM_STAGES=3),
                       dict(num_warps=4)),
    "fwd_state_bv64": ("_fwd_state", dict(_STATE, BV=64, HAS_H0=True, STORE_HT=True, SAVE=False, NUM_STAGES=2),
                       dict(num_warps=4)),
    "bwd_state_bv16": ("_bwd_state", dict(_STATE, BV=16, HAS_DHT=False, HAS_H0=False, NUM_STAGES=3),
                       dict(num_warps=4)),
    "bwd_prep": ("_bwd_prep", dict(BK=128, KA=32, BVF=128, BV=64, PREC="tf32"), dict(num_warps=4, num_stages=1)),
    "bwd_intra": ("_bwd_intra", dict(BK=128, BKS=32, PREC="tf32"), dict(num_warps=4, num_stages=2)),
    "intra_whole": ("_fwd_intra", dict(CONSTEXPRS, SAVE=True, WHOLE=True), dict(num_warps=4, num_stages=3,
                                                                              maxnreg=168)),
    "intra_blocks": ("_fwd_intra", dict(CONSTEXPRS, SAVE=True, WHOLE=False), dict(num_warps=4, num_stages=3)),
    "recurrent": ("_recurrent_fwd", _RECURRENT, dict(num_warps=4)),
    # the token loop not pipelined (the decode's launch before DECODE_STAGES)
    "recurrent_stages1": ("_recurrent_fwd", dict(_RECURRENT, STAGES=1), dict(num_warps=4)),
    # q / k / beta not prefetched by hand (the decode's launch before session 37)
    "recurrent_no_prefetch_qk": ("_recurrent_fwd", dict(_RECURRENT, PREFETCH_QK=False), dict(num_warps=4)),
    "recurrent_default_gate": ("_recurrent_fwd", dict(_RECURRENT, GATE=1, L2NORM=True, VARLEN=True, HAS_IDX=True,
                                                      BETA_SIGMOID=1, BETA_LOGIT_SCALE=1, STATE_V_FIRST=True),
                               dict(num_warps=4)),
    "cumsum_default_gate": ("_fwd_cumsum", dict(BK=128, KA=32, GATE=1, HAS_A=True, HAS_DT=True), dict(num_warps=4)),
    "gate_bwd_default": ("_gate_bwd", dict(BK=128, ROWS=64, STEPS=4, GATE=1, HAS_A=True, HAS_DT=True),
                         dict(num_warps=4)),
    "gate_bwd_safe": ("_gate_bwd", dict(BK=128, ROWS=64, STEPS=4, GATE=2, HAS_A=True, HAS_DT=True),
                      dict(num_warps=4)),
    # the step-inputs kernel took SAFE_GATE (a bool) before the named gate modes
    "step_inputs_safe": ("_step_inputs_kernel", dict(W=4, BK=128, HAS_WINDOW=True, WITH_Q=True, GATE=2,
                                                     SAFE_GATE=True, HAS_ROLL=False), dict(num_warps=1)),
    "step_inputs_default": ("_step_inputs_kernel", dict(W=4, BK=128, HAS_WINDOW=True, WITH_Q=False, GATE=1,
                                                        SAFE_GATE=False, HAS_ROLL=True), dict(num_warps=1)),
}


def _find_kernel(name: str):
    """The version's Triton kernel `name`, wherever its layout keeps it (chunk.py before the split)."""
    for sub in ("chunk_fwd", "chunk_intra", "chunk_bwd", "chunk_bwd_intra", "chunk", "fused_recurrent", "gate",
                "step_inputs"):
        try:
            mod = importlib.import_module("k3_kernels.kda." + sub)
        except ImportError:
            continue
        if hasattr(getattr(mod, name, None), "arg_names"):
            return getattr(mod, name)
    raise SystemExit(f"no kernel {name}")


def _all_worker() -> dict:
    """{case: [SASS hash without symbol names, instructions]} of ALL_CASES in this version."""
    out = {}
    for case, (name, constexprs, options) in ALL_CASES.items():
        fn = _find_kernel(name)
        consts = {k: v for k, v in constexprs.items() if k in fn.arg_names}
        sig, cs, attrs = {}, {}, {}
        for i, arg in enumerate(fn.arg_names):
            if arg in consts:
                sig[arg], cs[(i,)] = "constexpr", consts[arg]
            else:
                sig[arg] = ALL_TYPES.get(arg, "*bf16")
                if sig[arg].startswith("*"):
                    attrs[(i,)] = [["tt.divisibility", 16]]
        kernel = triton.compile(ASTSource(fn, sig, cs, attrs), target=GPUTarget("cuda", 90, 32), options=options)
        with tempfile.TemporaryDirectory() as d:
            cubin = os.path.join(d, "k.cubin")
            with open(cubin, "wb") as f:
                f.write(kernel.asm["cubin"])
            sass = subprocess.run([os.path.join(TOOLS, "cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                                  check=True).stdout
        lines = [re.sub(r"/\*[0-9a-f]+\*/", "", x).strip() for x in sass.splitlines()
                 if re.match(r"^\s+/\*[0-9a-f]+\*/\s+\S", x)]
        lines = [re.sub(r"\b\w*_(fwd|bwd|recurrent)\w*", "F", x) for x in lines]
        out[case] = [hashlib.sha1("\n".join(lines).encode()).hexdigest()[:12], len(lines)]
    return out


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
        print(json.dumps(_all_worker() if "--all" in sys.argv else _worker()))
        return
    if "--all" in sys.argv:
        versions = [a.split("=", 1) for a in sys.argv[1:] if a != "--all"]
        hashes = {name: run_in_version(path, "benchmarks.kda_sass", ("--all",)) for name, path in versions}
        for name, h in hashes.items():
            if "error" in h:
                raise SystemExit(f"{name}: build failed\n{h['error']}")
        for case in ALL_CASES:
            row = [hashes[name][case] for name, _ in versions]
            print(f"{case:>18}: " + "  ".join(f"{n}={h} ({c} instr)" for (n, _), (h, c) in zip(versions, row)),
                  "same" if len({h for h, _ in row}) == 1 else "DIFFERENT")
        print(json.dumps(hashes))
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
