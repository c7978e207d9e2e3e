"""benchmarks/moe_processes.py turns the device's per-process layer JSONs into the file a README row names: its
medians must be of the right processes (by label and token count), the speedup TorchTitan's time over ours, and
the bit flag false as soon as one process failed its rerun or batch-composition check."""
import json

from benchmarks.moe_processes import process_rows, summarise


def _process(points):
    return {"points": [{"tokens": n, "torchtitan": {"fwd_ms": 2 * t, "fwd_bwd_ms": 6 * t},
                        "ours_fp8_full": {"fwd_ms": t, "fwd_bwd_ms": 4 * t, "bitwise_rerun": ok,
                                          "routed_batch_invariant": True}} for n, t, ok in points]}


def test_medians_per_label_and_point():
    procs = [{"label": "a", "rows": process_rows(_process([(4096, 1.0, True), (16384, 2.0, True)]), "ours_fp8_full")},
             {"label": "a", "rows": process_rows(_process([(4096, 3.0, True)]), "ours_fp8_full")},
             {"label": "b", "rows": process_rows(_process([(4096, 1.0, False)]), "ours_fp8_full")}]
    s = summarise(procs)
    assert s["a"]["4096"]["processes"] == 2 and s["a"]["16384"]["processes"] == 1
    assert s["a"]["4096"]["ours_fwd_bwd_ms_median"] == 8.0 and s["a"]["4096"]["torchtitan_fwd_bwd_ms_median"] == 12.0
    assert s["a"]["4096"]["speedup_fwd_bwd_median"] == 1.5 and s["a"]["4096"]["speedup_fwd_median"] == 2.0
    assert s["a"]["4096"]["all_bitwise_and_invariant"] and not s["b"]["4096"]["all_bitwise_and_invariant"]
    json.dumps(s)  # what main() writes


def test_points_without_both_impls_are_left_out():
    result = _process([(4096, 1.0, True)])
    del result["points"][0]["torchtitan"]
    assert process_rows(result, "ours_fp8_full") == {}
