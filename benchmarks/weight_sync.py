"""XOR-delta weight sync on real RL-like updates (issue 5).

Trains the K3 `tiny` and `small` presets (k3.model.K3ForCausalLM) for 50 steps with AdamW (fp32 master
weights; the published weights are their bf16 cast) at LR 1e-6 and 1e-5 on next-token cross-entropy over
deterministic synthetic text-like tokens (a Zipfian Markov chain). After every step the new bf16 state is
published and, in the same process, encoded as:
  * ours: k3.sync XOR delta (byte-plane shuffle + zstd level 1, 4 MiB chunks, threads = CPUs),
    decoded by a WeightReceiver and checked bit for bit against the published state;
  * positions+values, verl `delta_sharded` style: int32 positions of changed elements + their new values
    (raw, as verl sends them), and the same buffer zstd-compressed at level 1 (slime `deltas_zstd` style);
  * plain zstd (level 1, same threads) of the full bf16 checkpoint; raw full checkpoint bytes;
  * XOR variants for the shuffle/level choice: no shuffle level 1, shuffle level 3.
Totals over the 50 steps use a full snapshot every 25 versions (WeightPublisher's default chain:
v0 full is the initial deployment; v25 and v50 are full; the other 48 are deltas), as in Fireworks'
accounting. Encode/decode GB/s = raw bf16 bytes / wall time (median over steps; the CPU is shared with
other processes: load averages are recorded).

`--gpu` (run on the H200) instead measures the GPU stage: Triton XOR vs torch.bitwise_xor on large bf16
buffers, and the GPU-path encode (Triton XOR -> pinned host -> zstd) and CUDA receiver apply.

Writes benchmarks/results/weight_sync.json (or $OUT/weight_sync_gpu.json for --gpu).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import zstandard as zstd

from benchmarks._results import git_state
from k3.sync import WeightReceiver, encode_delta, encode_full, states_equal
from k3.sync.codec import default_threads, host_bytes

RESULTS = Path(__file__).parent / "results"
FULL_EVERY = 25


# ------------------------------------------------------------------------------------------ data
def token_stream(vocab: int, n_tokens: int, seed: int = 0) -> np.ndarray:
    """Deterministic text-like tokens: a Markov chain whose successors and unigram are Zipfian."""
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, vocab + 1, dtype=np.float64)
    unigram = (1 / ranks) / (1 / ranks).sum()
    succ = rng.choice(vocab, size=(vocab, 8), p=unigram)
    succ_p = (1 / np.arange(1, 9)) / (1 / np.arange(1, 9)).sum()
    out = np.empty(n_tokens, dtype=np.int64)
    out[0] = 1
    follow = rng.random(n_tokens) < 0.85
    pick = rng.choice(8, size=n_tokens, p=succ_p)
    fresh = rng.choice(vocab, size=n_tokens, p=unigram)
    for i in range(1, n_tokens):
        out[i] = succ[out[i - 1], pick[i]] if follow[i] else fresh[i]
    return out


# ------------------------------------------------------------------------------------------ baselines
def positions_values(prev: dict[str, torch.Tensor], cur: dict[str, torch.Tensor], cctx) -> tuple[int, int, int]:
    """(changed elements, verl-style int32 positions + values bytes, the same buffer zstd-compressed)."""
    changed, raw, parts = 0, 0, []
    for k, c in cur.items():
        word = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[c.element_size()]
        pw, cw = host_bytes(prev[k]).view(word), host_bytes(c).view(word)
        pos = np.flatnonzero(pw != cw)
        changed += pos.size
        buf = pos.astype(np.int32).tobytes() + cw[pos].tobytes()
        raw += len(buf) + 16  # + per-tensor (name id, count) header
        parts.append(buf)
    comp = len(cctx.compress(b"".join(parts)))
    return changed, raw, comp


def full_bytes(state: dict[str, torch.Tensor]) -> bytes:
    return b"".join(host_bytes(t).tobytes() for t in state.values())


# ------------------------------------------------------------------------------------------ one run
def run(preset: str, lr: float, steps: int, batch: int, seq: int, budget_s: float, detail_every: int,
        fused: bool = True, seed: int = 0) -> dict:
    from k3.config import K3Config
    from k3.model import K3ForCausalLM

    torch.manual_seed(seed)
    cfg = K3Config.preset(preset)
    model = K3ForCausalLM(cfg).float()
    # fused: one pass over the fp32 master weights, no per-step temporaries (same AdamW update rule)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.01, fused=fused)
    data = torch.from_numpy(token_stream(cfg.vocab_size, steps * batch * (seq + 1) + 1, seed))
    threads = default_threads()
    zfull = zstd.ZstdCompressor(level=1, threads=threads)

    def publish() -> dict[str, torch.Tensor]:
        return {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}

    prev = publish()
    raw_full = sum(t.numel() * t.element_size() for t in prev.values())
    receiver = WeightReceiver({k: v.clone() for k, v in prev.items()}, 0)
    full_payload0 = encode_full(prev, 0)
    rows, t_start = [], time.time()
    for step in range(1, steps + 1):
        if time.time() - t_start > budget_s:
            break
        ids = data[(step - 1) * batch * (seq + 1):step * batch * (seq + 1)].reshape(batch, seq + 1)
        t0 = time.perf_counter()
        logits = model(ids[:, :-1], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        t_train = time.perf_counter() - t0
        cur = publish()

        t0 = time.perf_counter()
        payload = encode_delta(prev, cur, step - 1, step)
        t_enc = time.perf_counter() - t0
        t0 = time.perf_counter()
        receiver.apply(payload)
        t_dec = time.perf_counter() - t0
        exact = receiver.version == step and states_equal(receiver.state_dict(), cur)
        if not exact:
            raise SystemExit(f"{preset} lr={lr} step {step}: decoded weights differ from the published ones")
        changed, pv_raw, pv_zstd = positions_values(prev, cur, zstd.ZstdCompressor(level=1))
        row = {"step": step, "loss": round(loss.item(), 5), "train_s": round(t_train, 3), "raw_bytes": raw_full,
               "xor_zstd_bytes": len(payload), "changed_elems": changed, "posval_bytes": pv_raw,
               "posval_zstd_bytes": pv_zstd, "encode_s": t_enc, "decode_s": t_dec, "bit_exact": exact}
        if step % FULL_EVERY == 0:
            t0 = time.perf_counter()
            row["full_payload_bytes"] = len(encode_full(cur, step))
            row["full_encode_s"] = time.perf_counter() - t0
        if step == 1 or step % detail_every == 0:
            row["xor_zstd_noshuffle_bytes"] = len(encode_delta(prev, cur, step - 1, step, shuffle=False))
            row["xor_zstd_dense_bytes"] = len(encode_delta(prev, cur, step - 1, step, sparse=False))
            row["xor_zstd_l3_bytes"] = len(encode_delta(prev, cur, step - 1, step, level=3))
            t0 = time.perf_counter()
            row["plain_zstd_full_bytes"] = len(zfull.compress(full_bytes(cur)))
            row["plain_zstd_full_s"] = time.perf_counter() - t0
        rows.append(row)
        prev = cur
        print(f"  {preset} lr={lr:g} step {step:2d} loss {row['loss']:.4f} changed "
              f"{changed / (raw_full / 2):7.3%} xor+zstd {len(payload) / raw_full:7.3%} posval "
              f"{pv_raw / raw_full:7.3%} enc {raw_full / t_enc / 1e9:5.2f} GB/s dec {raw_full / t_dec / 1e9:5.2f} GB/s "
              f"(train {t_train:.1f}s)", flush=True)
    out = summarize(preset, lr, rows, raw_full, len(full_payload0), steps, batch, seq, time.time() - t_start)
    out["adamw_impl"] = "fused" if fused else "foreach"
    return out


def summarize(preset, lr, rows, raw_full, full0, steps_asked, batch, seq, wall) -> dict:
    n = len(rows)
    deltas = [r for r in rows if r["step"] % FULL_EVERY != 0]
    fulls = [r for r in rows if r["step"] % FULL_EVERY == 0]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    detail = [r for r in rows if "plain_zstd_full_bytes" in r]
    full_payload = med([r["full_payload_bytes"] for r in fulls]) or full0
    chain_total = sum(r["xor_zstd_bytes"] for r in deltas) + sum(r["full_payload_bytes"] for r in fulls)
    pz = med([r["plain_zstd_full_bytes"] for r in detail])
    out = {
        "preset": preset, "lr": lr, "params": raw_full // 2, "steps_done": n, "steps_asked": steps_asked,
        "tokens_per_step": batch * seq, "wall_s": round(wall, 1), "raw_full_bytes": raw_full,
        "bit_exact_all_steps": all(r["bit_exact"] for r in rows),
        "delta_ratio_median": med([r["xor_zstd_bytes"] / raw_full for r in deltas]),
        "delta_ratio_max": max((r["xor_zstd_bytes"] / raw_full for r in deltas), default=None),
        "changed_frac_median": med([r["changed_elems"] / (raw_full / 2) for r in deltas]),
        "posval_ratio_median": med([r["posval_bytes"] / raw_full for r in deltas]),
        "posval_zstd_ratio_median": med([r["posval_zstd_bytes"] / raw_full for r in deltas]),
        **posval_over_xor(rows),
        "xor_noshuffle_ratio_median": med([r["xor_zstd_noshuffle_bytes"] / raw_full for r in detail]),
        "xor_dense_ratio_median": med([r["xor_zstd_dense_bytes"] / raw_full for r in detail
                                       if "xor_zstd_dense_bytes" in r]),
        "xor_l3_ratio_median": med([r["xor_zstd_l3_bytes"] / raw_full for r in detail]),
        "plain_zstd_full_ratio": pz / raw_full if pz else None,
        "full_payload_ratio": full_payload / raw_full,
        "encode_GBps_median": med([raw_full / r["encode_s"] / 1e9 for r in rows]),
        "decode_GBps_median": med([raw_full / r["decode_s"] / 1e9 for r in rows]),
        "chain_total_bytes": chain_total,
        "chain_total_vs_raw_every_step": chain_total / (n * raw_full) if n else None,
        "chain_total_vs_plain_zstd_every_step": chain_total / (n * pz) if n and pz else None,
        "posval_total_vs_raw_every_step": ((sum(r["posval_bytes"] for r in deltas) + len(fulls) * raw_full)
                                           / (n * raw_full)) if n else None,
        "per_step": rows,
    }
    return out


def posval_over_xor(rows: list[dict]) -> dict:
    """How many times smaller ours is than positions+values, raw (verl) and zstd-compressed (slime), per delta step
    (median over the delta steps of the same run)."""
    deltas = [r for r in rows if r["step"] % FULL_EVERY != 0]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {"posval_over_xor_median": med([r["posval_bytes"] / r["xor_zstd_bytes"] for r in deltas]),
            "posval_zstd_over_xor_median": med([r["posval_zstd_bytes"] / r["xor_zstd_bytes"] for r in deltas])}


def refresh_summaries(path: Path) -> None:
    """Add summary keys computed from a results file's own per-step rows (no re-measurement)."""
    res = json.loads(path.read_text())
    for run in res["runs"]:
        run.update(posval_over_xor(run["per_step"]))
    res["derived_keys"] = {"keys": ["posval_over_xor_median", "posval_zstd_over_xor_median"],
                           "from": "each run's per_step rows (benchmarks/weight_sync.py --refresh-summaries)",
                           "script_commit": git_state()["commit"]}
    path.write_text(json.dumps(res, indent=1))
    print_table(res)


# ------------------------------------------------------------------------------------------ GPU stage
def gpu_bench(out_dir: Path) -> None:
    from triton.testing import do_bench

    from k3_kernels.xor import xor_bytes

    dev = torch.device("cuda")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "host_threads": default_threads()}
    for gib in (1, 4):
        n = gib * 2**30 // 2
        a = torch.randn(n, device=dev).to(torch.bfloat16)
        b = a.clone()
        b.view(torch.int16)[::97] ^= 1
        out = torch.empty(n * 2, dtype=torch.uint8, device=dev)
        t_tri = do_bench(lambda: xor_bytes(a, b, out=out), warmup=10, rep=200, return_mode="median")
        t_torch = do_bench(lambda: torch.bitwise_xor(a.view(torch.int16), b.view(torch.int16),
                                                     out=out.view(torch.int16)), warmup=10, rep=200,
                           return_mode="median")
        moved = 3 * n * 2  # read a, b; write out
        res[f"xor_{gib}GiB"] = {"triton_ms": t_tri, "torch_bitwise_xor_ms": t_torch,
                                "triton_GBps_moved": moved / t_tri / 1e6, "torch_GBps_moved": moved / t_torch / 1e6,
                                "triton_GBps_weights": n * 2 / t_tri / 1e6}
    # end-to-end GPU path on a 2 GiB bf16 state with ~1% of values changed by one ulp (synthetic content)
    g = torch.Generator(device=dev).manual_seed(0)
    base = {f"w{i}": (torch.randn(2**26, device=dev, generator=g) * 0.02).to(torch.bfloat16) for i in range(16)}
    new = {}
    for k, v in base.items():
        bits = v.view(torch.int16).clone()
        mask = torch.rand(v.shape, device=dev, generator=g) < 0.01
        bits[mask] += 1
        new[k] = bits.view(torch.bfloat16)
    raw = sum(v.numel() * 2 for v in new.values())
    encode_delta(base, new, 0, 1)  # warm-up (Triton compile, pinned buffers)
    t0 = time.perf_counter()
    payload = encode_delta(base, new, 0, 1)
    torch.cuda.synchronize()
    t_enc = time.perf_counter() - t0
    recv = WeightReceiver({k: v.clone() for k, v in base.items()}, 0)
    t0 = time.perf_counter()
    recv.apply(payload)
    torch.cuda.synchronize()
    t_dec = time.perf_counter() - t0
    exact = states_equal(recv.state_dict(), new)
    cpu_base = {k: v.cpu() for k, v in base.items()}
    cpu_new = {k: v.cpu() for k, v in new.items()}
    t0 = time.perf_counter()
    cpu_payload = encode_delta(cpu_base, cpu_new, 0, 1)
    t_cpu = time.perf_counter() - t0
    res["gpu_path_2GiB"] = {"raw_bytes": raw, "payload_bytes": len(payload), "ratio": len(payload) / raw,
                            "encode_GBps": raw / t_enc / 1e9, "cuda_receiver_apply_GBps": raw / t_dec / 1e9,
                            "bit_exact": exact, "host_cpu_encode_GBps_same_machine": raw / t_cpu / 1e9,
                            "payload_equal_cpu_path_size": len(cpu_payload)}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "weight_sync_gpu.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


# ------------------------------------------------------------------------------------------ main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--lrs", default="1e-6,1e-5")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--tiny-tokens", default="2x32", help="batch x seq per step for tiny")
    ap.add_argument("--small-tokens", default="1x16", help="batch x seq per step for small")
    ap.add_argument("--small-budget-s", type=float, default=180.0, help="wall budget per small run")
    ap.add_argument("--gpu", action="store_true", help="GPU stage benchmark (H200)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--merge", action="store_true", help="keep the runs (preset, lr) not redone that are already in --out")
    ap.add_argument("--refresh-summaries", action="store_true",
                    help="recompute derived summary keys of --out from its per-step rows, measuring nothing")
    args = ap.parse_args()
    if args.refresh_summaries:
        refresh_summaries(Path(args.out) if args.out else RESULTS / "weight_sync.json")
        return
    if args.gpu:
        gpu_bench(Path(os.environ.get("OUT", RESULTS)))
        return
    import xxhash

    load0, tree = os.getloadavg(), git_state()   # the commit measured, taken before the runs
    runs = []
    for preset in args.presets.split(","):
        b, s = map(int, (args.tiny_tokens if preset == "tiny" else args.small_tokens).split("x"))
        budget = args.small_budget_s if preset == "small" else 1e9
        detail = 1 if preset == "tiny" else 5
        for lr in map(float, args.lrs.split(",")):
            print(f"== {preset} lr={lr:g} ({b}x{s} tokens/step)", flush=True)
            runs.append(run(preset, lr, args.steps, b, s, budget, detail))
    res = {**tree, "benchmark": "weight_sync", "device": f"CPU {platform.processor() or platform.machine()}, "
           f"{os.cpu_count()} logical CPUs", "python": sys.version.split()[0], "torch": torch.__version__,
           "numpy": np.__version__, "zstandard": zstd.__version__, "xxhash": xxhash.VERSION,
           "codec": {"level": 1, "chunk_bytes": 4 << 20, "shuffle": True, "threads": default_threads()},
           "full_every": FULL_EVERY, "loadavg_start": load0, "loadavg_end": os.getloadavg(), "runs": runs}
    gpu = RESULTS / "weight_sync_gpu.json"
    if gpu.exists():
        res["gpu"] = json.loads(gpu.read_text())
    out = Path(args.out) if args.out else RESULTS / "weight_sync.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.merge and out.exists():
        done = {(r["preset"], r["lr"]) for r in runs}
        old = json.loads(out.read_text())
        res["runs"] = [r for r in old["runs"] if (r["preset"], r["lr"]) not in done] + runs
        res["runs"].sort(key=lambda r: (r["preset"] != "tiny", r["lr"]))
        res["loadavg_earlier_runs"] = [old.get("loadavg_start"), old.get("loadavg_end")]
    out.write_text(json.dumps(res, indent=1))
    print_table(res)


def print_table(res: dict) -> None:
    pct = lambda x: f"{100 * x:.3f}%" if x is not None else "-"  # noqa: E731
    print(f"\n{'preset':6} {'lr':>6} {'steps':>5} {'changed':>8} {'xor+zstd':>9} {'max':>8} {'noshuf':>8} "
          f"{'posval':>8} {'pv+zstd':>8} {'pv/ours':>7} {'pvz/ours':>8} {'zstdfull':>8} {'chain50':>8} "
          f"{'enc GB/s':>8} {'dec GB/s':>8} exact")
    for r in res["runs"]:
        print(f"{r['preset']:6} {r['lr']:6g} {r['steps_done']:5d} {pct(r['changed_frac_median']):>8} "
              f"{pct(r['delta_ratio_median']):>9} {pct(r['delta_ratio_max']):>8} "
              f"{pct(r['xor_noshuffle_ratio_median']):>8} {pct(r['posval_ratio_median']):>8} "
              f"{pct(r['posval_zstd_ratio_median']):>8} {r.get('posval_over_xor_median') or 0:7.2f} "
              f"{r.get('posval_zstd_over_xor_median') or 0:8.2f} {pct(r['plain_zstd_full_ratio']):>8} "
              f"{pct(r['chain_total_vs_raw_every_step']):>8} {r['encode_GBps_median']:8.2f} "
              f"{r['decode_GBps_median']:8.2f} {r['bit_exact_all_steps']}")


if __name__ == "__main__":
    main()
