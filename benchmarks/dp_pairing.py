"""DP prefill pairing on an RL rollout trace: no pairing vs SGLang's PrefillDelayer (its own decision code, at its
default and tighter pass caps) vs ours (k3.rollout.dp_pairing through the AROUND hook on the same delayer).

The simulator (k3.rollout.dp_pairing.simulate) runs forward passes over DP-attention ranks: each pass a rank either
prefills (chunked, `prefill_budget` tokens) or decodes all its running requests; the MoE/MLP exchange pads every
rank to the largest batch. Counted per policy: forward passes to drain the trace, padding tokens (sum over passes
and ranks of largest batch minus own), decode stalls (request-passes lost to the own rank's prefill pass),
stretched decode passes (rank-passes that decoded inside a pass where another rank prefilled), delayed passes, and
the admission wait of every turn (passes from its arrival to its first prefill pass). Traces: GRPO groups of
multi-turn tool-calling episodes (later turns prefill only the tool output, the prefix being cached), on 8 ranks
with every rank busy, on 16 ranks (Kimi-K3 dp16) with two ranks that never get work, and the tail of a rollout
on 16 ranks (three ranks still hold episodes, the others are done).
Runs in .venv-sglang (SGLang's PrefillDelayer is imported). Writes benchmarks/results/dp_pairing.json.
"""
from __future__ import annotations

import argparse
import time

import benchmarks._sglang_cpu  # noqa: F401  (before SGLang)
from benchmarks._results import run_header, write_results
from k3.rollout.dp_pairing import PairingConfig, SimConfig, bounded_pairing_policy, no_pairing, rl_trace, simulate

TRACES = {
    "dp8_all_busy": dict(ranks=8, groups=24, group_size=8, idle_ranks=0),
    "dp16_two_idle": dict(ranks=16, groups=32, group_size=8, idle_ranks=2),
    "dp16_rollout_tail": dict(ranks=16, groups=4, group_size=3, idle_ranks=13),
}
CAPS = (30, 8, 4)     # --prefill-delayer-max-delay-passes (at most cap - 1 delayed passes, both policies)
SHAPE = dict(turns=(1, 4), prompt=(1000, 4000), gen=(50, 600), tool=(20, 300), tool_wait=(2, 30), group_gap=40)


def policies(max_running: int):
    from k3_sglang.dp_pairing import delayer_policy

    out = {"none": lambda: no_pairing}
    for cap in CAPS:
        out[f"sglang_delayer_max{cap}"] = lambda cap=cap: delayer_policy(cap, max_running, ours=False)
        out[f"k3_bounded_max{cap}"] = lambda cap=cap: delayer_policy(cap, max_running, ours=True)
        out[f"k3_bounded_max{cap}_rule_only"] = lambda cap=cap: bounded_pairing_policy(PairingConfig(cap - 1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="dp_pairing")
    args = ap.parse_args()
    sim = SimConfig()
    result = {**run_header("dp_pairing", device="cpu", packages=("sglang",)),
              "sim": {"prefill_budget": sim.prefill_budget, "max_running": sim.max_running},
              "trace_shape": {k: list(v) if isinstance(v, tuple) else v for k, v in SHAPE.items()}, "traces": {}}
    for tname, t in TRACES.items():
        trace = rl_trace(args.seed, t["ranks"], t["groups"], t["group_size"], idle_ranks=t["idle_ranks"], **SHAPE)
        cfg = SimConfig(ranks=t["ranks"])
        rows = {}
        for name, make in policies(cfg.max_running).items():
            t0 = time.perf_counter()
            rows[name] = simulate(trace, cfg, make()).summary() | {"sim_wall_s": time.perf_counter() - t0}
        for cap in CAPS:     # the hook inside SGLang's delayer decides exactly as the rule
            a, b = dict(rows[f"k3_bounded_max{cap}"]), dict(rows[f"k3_bounded_max{cap}_rule_only"])
            a.pop("sim_wall_s"), b.pop("sim_wall_s")
            assert a == b, f"hooked delayer and k3 rule disagree at cap {cap}"
            del rows[f"k3_bounded_max{cap}_rule_only"]
        result["traces"][tname] = {**t, "turns_total": sum(len(r.turns) for r in trace), "policies": rows}
    path = write_results(args.out, result)
    for tname, tr in result["traces"].items():
        print(f"\n{tname} ({tr['ranks']} ranks, {tr['idle_ranks']} idle, {tr['turns_total']} turns)")
        print(f"{'policy':24s}{'passes':>8s}{'padding':>10s}{'pad %':>7s}{'stalls':>8s}{'stretched':>10s}"
              f"{'delayed':>8s}{'wait mean':>10s}{'p99':>5s}{'max':>5s}")
        for name, r in tr["policies"].items():
            print(f"{name:24s}{r['passes']:8d}{r['padding_tokens']:10d}{100 * r['padding_fraction']:7.1f}"
                  f"{r['decode_stalls']:8d}{r['stretched_decode_passes']:10d}{r['delayed_passes']:8d}"
                  f"{r['admission_wait_mean']:10.2f}{r['admission_wait_p99']:5d}{r['admission_wait_max']:5d}")
    print("wrote", path)


if __name__ == "__main__":
    main()
