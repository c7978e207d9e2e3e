"""Serverless multi-LoRA training under load (loopback): N clients each running GSPO updates of the calculator
task through `k3 serve`'s client, concurrently vs one after another, in one process.

    python benchmarks/serverless.py --max-batch-rows 32         # -> benchmarks/results/serverless_cpu.json
    python benchmarks/serverless.py --device cuda --preset small   # -> benchmarks/results/serverless.json (H200)

Service settings not given on the command line are ServeConfig's defaults (the engine's: the device's).
* headline: 8 clients x 5 GSPO updates, concurrent vs the same 8 runs one after another: throughput (samples/s,
  trained tokens/s), p50/p99 latency per call kind, and no cross-talk (every adapter after the concurrent run is
  bitwise equal to its run alone);
* sweep: 1, 4, 8, 16 concurrent sessions x `--sweep-updates` updates: throughput against the one-at-a-time
  throughput measured above, and Jain's fairness index over the sessions' own throughputs (samples / own wall).
The model is a K3 preset (`--preset`, random weights: the task's rewards are not the point here, the service is);
the server runs as `python -m k3.cli serve` in a subprocess (the `k3` script need not be installed), the clients as
threads of this process. `--budget-s` skips the sweep points that would start after that many seconds (the JSON is
written after every phase)."""
from __future__ import annotations

import argparse
import dataclasses
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load as load_safetensors  # noqa: E402

from benchmarks._results import run_header, write_results  # noqa: E402
from k3.envs import CalculatorEnv  # noqa: E402
from k3.jobs.config import JobConfig  # noqa: E402
from k3.serverless.client import ServiceClient  # noqa: E402
from k3.serverless.config import ServeConfig  # noqa: E402
from k3.serverless.job import gspo_update  # noqa: E402


def job_config(seed: int, rank: int = 8) -> JobConfig:
    cfg = JobConfig()
    cfg.rollout.tasks_per_update, cfg.rollout.group_size, cfg.rollout.max_turn_tokens = 2, 4, 8
    cfg.rl.train_seed, cfg.rl.lora_rank = seed, rank
    cfg.rl.router_replay = False   # the measured workload of serverless.json (R3 through the service: tests)
    return cfg


def call_kind(method: str, path: str) -> str:
    """The client call an HTTP request belongs to (for the latency table)."""
    parts = path.strip("/").split("/")
    if parts == ["sessions"]:
        return "create_lora_training_client"
    if parts[0] == "sessions" and len(parts) == 2:
        return "delete" if method == "DELETE" else "get_info"
    if parts[-1] == "samplers":
        return "save_weights_for_sampler"
    if parts[-1] == "weights":
        return "download_weights"
    return {"logprobs": "compute_logprobs", "info": "get_server_capabilities"}.get(parts[-1], parts[-1])


class Timed:
    """Records the wall time of every HTTP call of a client, by client call."""

    def __init__(self, client: ServiceClient, sink: dict[str, list[float]], lock: threading.Lock) -> None:
        http = client._http
        orig = http.call

        def call(method, path, key, body=None, raw=False):
            t0 = time.perf_counter()
            try:
                return orig(method, path, key, body, raw)
            finally:
                with lock:
                    sink.setdefault(call_kind(method, path), []).append(time.perf_counter() - t0)
        http.call = call


def run_client(url: str, seed: int, updates: int, lat: dict, lock: threading.Lock, out: dict, rank: int) -> None:
    client = ServiceClient(url)
    Timed(client, lat, lock)
    cfg = job_config(seed, rank)
    info = client.get_server_capabilities()
    t0 = time.perf_counter()
    tc = client.create_lora_training_client(info["base_model"], rank=cfg.rl.lora_rank, alpha=cfg.rl.lora_alpha,
                                            seed=seed)
    env = CalculatorEnv()
    samples = tokens = 0
    for u in range(1, updates + 1):
        row = gspo_update(tc, cfg, u, env, info["max_data"])
        samples += row["samples"]
        tokens += row["trained_tokens"]
    out[seed] = {"samples": samples, "trained_tokens": tokens, "wall_s": time.perf_counter() - t0,
                 "weights": load_safetensors(tc.download_weights()), "session": tc.session_id}
    tc.delete()
    client.close()


def server_counters(url: str) -> dict:
    """The server's cumulative counters (`GET /v1/stats`): scheduler rounds per kind, engine work, sample time."""
    return httpx.get(url + "/v1/stats", timeout=30).json()


def counter_diff(after, before):
    """after - before for every number of two nested counter dicts (kinds absent before count from 0)."""
    if isinstance(after, dict):
        return {k: counter_diff(v, before.get(k, {} if isinstance(v, dict) else 0)) for k, v in after.items()
                if isinstance(v, (dict, int, float)) and not isinstance(v, bool)}
    return after - before


def scenario(url: str, seeds: list[int], updates: int, concurrent: bool, rank: int = 8) -> dict:
    lat: dict[str, list[float]] = {}
    lock = threading.Lock()
    out: dict = {}
    load_before = os.getloadavg()[0]
    counters_before = server_counters(url)
    t0 = time.perf_counter()
    if concurrent:
        threads = [threading.Thread(target=run_client, args=(url, s, updates, lat, lock, out, rank)) for s in seeds]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for s in seeds:
            run_client(url, s, updates, lat, lock, out, rank)
    wall = time.perf_counter() - t0
    server = counter_diff(server_counters(url), counters_before)
    if len(out) != len(seeds):
        raise RuntimeError(f"{len(seeds) - len(out)} clients failed")
    samples = sum(v["samples"] for v in out.values())
    tokens = sum(v["trained_tokens"] for v in out.values())
    rates = [v["samples"] / v["wall_s"] for v in out.values()]
    return {"sessions": len(seeds), "updates_per_session": updates, "concurrent": concurrent, "wall_s": wall,
            "loadavg_1min_before_after": [load_before, os.getloadavg()[0]],
            "samples": samples, "trained_tokens": tokens, "samples_per_s": samples / wall,
            "trained_tokens_per_s": tokens / wall,
            "jain_fairness": sum(rates) ** 2 / (len(rates) * sum(r * r for r in rates)),
            "latency_s": {k: {"calls": len(v), "p50": statistics.median(v),
                              "p99": sorted(v)[min(len(v) - 1, int(0.99 * len(v)))]} for k, v in sorted(lat.items())},
            # where the server's time went: rounds per kind (sessions and rows they held, worker seconds), the
            # engine's forwards and tokens, a sample round's adapter loading vs generation
            "server": {k: server[k] for k in ("rounds_by_kind", "engine", "sample_load_s", "sample_generate_s")
                       if k in server},
            "_weights": {s: v["weights"] for s, v in out.items()}}


# `--server-moe torch`: the server's MoE on k3.model.moe's torch loop instead of k3_kernels.moe (an A/B knob;
# k3.model.ops reads ops.fused_moe at call time)
TORCH_MOE = ("import sys, k3.model.ops as ops; ops.fused_moe = lambda x: False; from k3.cli import main; "
             "sys.exit(main(sys.argv[1:]))")


@contextlib.contextmanager
def served(config: Path, port: int, log: Path, moe: str = "fused"):
    """`k3 serve --config config` in a subprocess until the block ends (its output in `log`)."""
    env = {**os.environ, "K3_CPU_THREADS": os.environ.get("K3_CPU_THREADS", "1")}
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    out = open(log, "wb")
    launcher = ["-m", "k3.cli"] if moe == "fused" else ["-c", TORCH_MOE]
    proc = subprocess.Popen([sys.executable, *launcher, "serve", "--config", str(config)], env=env,
                            stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"k3 serve exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(url + "/v1/info", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                if time.time() - t0 > 120:
                    raise RuntimeError("k3 serve did not start") from None
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        out.close()


def serve_toml(args, port: int, data_dir: str) -> str:
    """The server's config file: the benchmark's own settings, then the service settings given on the command line
    (the others keep ServeConfig's defaults, the device's engine defaults included)."""
    top = {"port": port, "data_dir": data_dir, "max_sessions": 64, "device": args.device, "preset": args.preset,
           "keep_samplers": 2, "max_batch_rows": args.max_batch_rows, "batch_wait_ms": args.batch_wait_ms}
    engine = {"decode_batch": args.decode_batch, "prefill_batch": args.prefill_batch,
              "max_step_tokens": args.max_step_tokens}
    lines = [f"{k} = {json.dumps(v)}" for k, v in top.items() if v is not None]
    given = [f"{k} = {v}" for k, v in engine.items() if v is not None]
    return "\n".join(lines + (["[engine]", *given] if given else [])) + "\n"


def strip(phase: dict) -> dict:
    """A phase's figures without the adapters' weights."""
    return {k: v for k, v in phase.items() if k != "_weights"}


def weight_diff(a: dict, b: dict) -> float:
    """Largest absolute difference between two adapters' tensors (0.0: bitwise equal)."""
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--updates", type=int, default=5)
    ap.add_argument("--passes", type=int, default=1, help="run the headline pair (one after another, concurrent) "
                    "this many times; the last is the headline, the others go under earlier_passes")
    ap.add_argument("--sweep", default="1,4,8,16")
    ap.add_argument("--sweep-updates", type=int, default=3)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--preset", default="tiny", help="K3Config preset of the served base (tiny, small)")
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--batch-wait-ms", type=int, default=None,
                    help="ServeConfig.batch_wait_ms of the server (default: ServeConfig's)")
    ap.add_argument("--max-batch-rows", type=int, default=None,
                    help="ServeConfig.max_batch_rows (default: ServeConfig's; 32 bounds the CPU's autograd memory "
                         "to ~3 GB)")
    ap.add_argument("--decode-batch", type=int, default=None,
                    help="the server engine's EngineConfig.decode_batch (default: the device's, ServeConfig)")
    ap.add_argument("--prefill-batch", type=int, default=None,
                    help="the server engine's EngineConfig.prefill_batch (default: the device's, ServeConfig)")
    ap.add_argument("--max-step-tokens", type=int, default=None,
                    help="the server engine's EngineConfig.max_step_tokens (default: the device's, ServeConfig)")
    ap.add_argument("--budget-s", type=float, default=0.0, help="skip sweep points starting after this (0: none)")
    ap.add_argument("--server-log", default=None, help="where the server's output goes (default: a temp file)")
    ap.add_argument("--wait-file", default=None, help="after the warm-up, wait (up to 120 s) until this file exists "
                    "(another job sharing the GPU, e.g. a test run, signals its end), so it overlaps no measurement")
    ap.add_argument("--server-moe", default="fused", choices=("fused", "torch"),
                    help="the server's MoE: ops' choice (k3_kernels.moe on CUDA) or the torch loop")
    ap.add_argument("--out", default=None, help="results name or path (default: serverless on CUDA, "
                    "serverless_cpu on CPU)")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("K3_CPU_THREADS", "1")))
    t_start = time.perf_counter()
    result = {**run_header("serverless", device=args.device if args.device == "cpu" else torch.cuda.get_device_name(),
                           packages=("fastapi", "uvicorn", "httpx", "triton")),
              "note": ("CPU figures (2-core shared dev box, loopback HTTP)" if args.device == "cpu" else
                       "GPU figures (server on the GPU, clients on the host, loopback HTTP)")
              + "; samples = episodes sampled (multi-turn), trained tokens = tokens with weight > 0 in "
                "forward_backward",
              "workload": {"tasks_per_update": 2, "group_size": 4, "max_turn_tokens": 8, "lora_rank": args.lora_rank,
                           "loss": "gspo", "preset": args.preset, "device": args.device,
                           "server_moe": args.server_moe,
                           "server": "k3 serve subprocess" + (", 1 torch thread" if args.device == "cpu" else "")}}
    out = args.out or ("serverless" if args.device == "cuda" else "serverless_cpu")
    with tempfile.TemporaryDirectory() as tmp:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # the server in its own process (`k3 serve`, as deployed): the clients' Python work here does not take
        # the server's GIL
        (Path(tmp) / "serve.toml").write_text(serve_toml(args, port, f"{tmp}/data"))
        served_cfg = ServeConfig.from_toml(Path(tmp) / "serve.toml")
        result["workload"].update(max_batch_rows=served_cfg.max_batch_rows, batch_wait_ms=served_cfg.batch_wait_ms,
                                  engine=dataclasses.asdict(served_cfg.engine_config()))
        log = Path(args.server_log) if args.server_log else Path(tmp) / "server.log"
        with served(Path(tmp) / "serve.toml", port, log, args.server_moe) as url:
            t0 = time.perf_counter()
            # warm-up (allocations, JIT compiles) in both shapes the phases below run: one session alone, then two
            scenario(url, [97], 1, concurrent=False, rank=args.lora_rank)
            scenario(url, [98, 99], 1, concurrent=True, rank=args.lora_rank)
            result["warmup_s"] = time.perf_counter() - t0
            if args.wait_file:
                t0 = time.perf_counter()
                while not Path(args.wait_file).exists() and time.perf_counter() - t0 < 120:
                    time.sleep(0.2)
                result["waited_for_other_job_s"] = time.perf_counter() - t0
            seeds = [100 + i for i in range(args.clients)]
            earlier, runs = [], []   # runs: every phase's adapters, each compared with the last solo run's
            for p in range(args.passes):
                # every pass runs the same sessions (same seeds: same shapes), so a later pass finds every kernel
                # compiled and every allocation made by the one before; the headline is the last pass
                if p:
                    earlier.append({"one_after_another": strip(seq), "concurrent": strip(conc)})
                    runs += [seq["_weights"], conc["_weights"]]
                seq = scenario(url, seeds, args.updates, concurrent=False, rank=args.lora_rank)
                print(f"pass {p + 1}: one after another: {seq['wall_s']:.1f} s, {seq['samples_per_s']:.2f} "
                      "samples/s", flush=True)
                write_results(out, {**result, "one_after_another": strip(seq), "earlier_passes": earlier,
                                    "partial": "the concurrent phase did not finish"})
                conc = scenario(url, seeds, args.updates, concurrent=True, rank=args.lora_rank)
                print(f"pass {p + 1}: concurrent:        {conc['wall_s']:.1f} s, {conc['samples_per_s']:.2f} "
                      "samples/s", flush=True)
            result["earlier_passes"] = earlier
            runs.append(conc["_weights"])
            diffs = {s: max(weight_diff(seq["_weights"][s], w[s]) for w in runs) for s in seeds}
            mismatched = [s for s in seeds if diffs[s] != 0.0]
            seq.pop("_weights")
            conc.pop("_weights")
            result.update({"one_after_another": seq, "concurrent": conc,
                           "speedup_samples_per_s": conc["samples_per_s"] / seq["samples_per_s"],
                           "speedup_trained_tokens_per_s": conc["trained_tokens_per_s"] / seq["trained_tokens_per_s"],
                           "no_cross_talk": not mismatched, "mismatched_sessions": mismatched,
                           "max_abs_weight_diff_vs_one_after_another": max(diffs.values()), "sweep": []})
            print(f"speedup {result['speedup_samples_per_s']:.2f}x samples/s; no cross-talk: {not mismatched} "
                  f"(max weight diff {max(diffs.values()):.3g})", flush=True)
            write_results(out, result)
            for n in [int(x) for x in args.sweep.split(",") if x]:
                if args.budget_s and time.perf_counter() - t_start > args.budget_s:
                    result.setdefault("sweep_skipped", []).append(n)
                    continue
                r = scenario(url, [1000 + i for i in range(n)], args.sweep_updates, concurrent=True,
                             rank=args.lora_rank)
                r.pop("_weights")
                r["speedup_vs_one_at_a_time"] = r["samples_per_s"] / seq["samples_per_s"]
                result["sweep"].append(r)
                print(f"{n:>3} sessions: {r['samples_per_s']:.2f} samples/s "
                      f"({r['speedup_vs_one_at_a_time']:.2f}x one-at-a-time), Jain {r['jain_fairness']:.3f}",
                      flush=True)
                write_results(out, result)
    result["total_s"] = time.perf_counter() - t_start
    print(f"wrote {write_results(out, result)}")


if __name__ == "__main__":
    main()
