"""Bundle `benchmarks/moe.py` layer processes into one results file: each process's own JSON kept whole, under a
label (the variant it ran: "base", "mul_quant", ...), and per label and token count the medians of the processes --
TorchTitan's and ours' forward+backward ms, the speedup's median / min / max, forward alone, and whether every
process was bitwise across reruns and batch-invariant.

    python -m benchmarks.moe_processes --out benchmarks/results/X.json --what "..." \
        --note base="main's kernels (a65786f)" --attach passes=/path/passes.json \
        base=/path/layer_2_base.json new=/path/layer_1_new.json ...

The device returns its processes' JSONs one per file; this is how several of them (and several calls) become the
one file a README row names.
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from benchmarks._results import run_header, write_results


def process_rows(result: dict, impl: str) -> dict[str, dict]:
    """{tokens: TorchTitan's and `impl`'s times, the speedups, the bit checks} of one process's JSON."""
    rows = {}
    for point in result["points"]:
        ours, titan = point.get(impl), point.get("torchtitan")
        if ours is None or titan is None:
            continue
        rows[str(point["tokens"])] = {
            "torchtitan_fwd_bwd_ms": titan["fwd_bwd_ms"], "ours_fwd_bwd_ms": ours["fwd_bwd_ms"],
            "torchtitan_fwd_ms": titan["fwd_ms"], "ours_fwd_ms": ours["fwd_ms"],
            "speedup_fwd_bwd": titan["fwd_bwd_ms"] / ours["fwd_bwd_ms"],
            "speedup_fwd": titan["fwd_ms"] / ours["fwd_ms"],
            "bitwise_and_invariant": bool(ours.get("bitwise_rerun") and ours.get("routed_batch_invariant"))}
    return rows


def summarise(processes: list[dict]) -> dict[str, dict[str, dict]]:
    """{label: {tokens: medians over that label's processes}}."""
    by_label: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for proc in processes:
        for tokens, row in proc["rows"].items():
            by_label[proc["label"]][tokens].append(row)
    out: dict[str, dict[str, dict]] = {}
    for label, points in by_label.items():
        out[label] = {}
        for tokens, rows in sorted(points.items(), key=lambda kv: int(kv[0])):
            speedups = [r["speedup_fwd_bwd"] for r in rows]
            out[label][tokens] = {
                "processes": len(rows),
                "speedup_fwd_bwd_median": statistics.median(speedups),
                "speedup_fwd_bwd_min": min(speedups), "speedup_fwd_bwd_max": max(speedups),
                "torchtitan_fwd_bwd_ms_median": statistics.median(r["torchtitan_fwd_bwd_ms"] for r in rows),
                "ours_fwd_bwd_ms_median": statistics.median(r["ours_fwd_bwd_ms"] for r in rows),
                "speedup_fwd_median": statistics.median(r["speedup_fwd"] for r in rows),
                "all_bitwise_and_invariant": all(r["bitwise_and_invariant"] for r in rows)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--what", required=True, help="what the processes compare (recorded)")
    ap.add_argument("--impl", default="ours_fp8_full", help="our implementation's key in the processes' points")
    ap.add_argument("--note", action="append", default=[], help="label=what that label ran (recorded)")
    ap.add_argument("--attach", action="append", default=[], help="name=path of another JSON of the same calls (a "
                    "pass sweep, say), kept whole under attached[name]")
    ap.add_argument("processes", nargs="+", help="label=path of one process's JSON (benchmarks/moe.py --out)")
    args = ap.parse_args()
    processes = []
    for item in args.processes:
        label, _, path = item.partition("=")
        if not path:
            raise SystemExit(f"{item!r}: expected label=path")
        result = json.loads(Path(path).read_text())
        processes.append({"label": label, "file": Path(path).name, "rows": process_rows(result, args.impl),
                          "result": result})
    summary = summarise(processes)
    out = {**run_header("moe_processes", device=processes[0]["result"].get("device", "?")), "what": args.what,
           "labels": dict(n.split("=", 1) for n in args.note), "summary": summary, "processes": processes,
           "attached": {name: json.loads(Path(path).read_text())
                        for name, path in (a.split("=", 1) for a in args.attach)}}
    write_results(args.out, out)
    for label, points in summary.items():
        print(label, {t: (round(p["speedup_fwd_bwd_median"], 3), round(p["speedup_fwd_bwd_min"], 3),
                          round(p["speedup_fwd_bwd_max"], 3)) for t, p in points.items()})


if __name__ == "__main__":
    main()
