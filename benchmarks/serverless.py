"""Serverless multi-LoRA training under load (loopback, CPU): N clients each running GSPO updates of the
calculator task through `k3 serve`'s client, concurrently vs one after another, in one process.

    python benchmarks/serverless.py            # -> benchmarks/results/serverless.json (CPU figures)

* headline: 8 clients x 5 GSPO updates, concurrent vs the same 8 runs one after another: throughput (samples/s,
  trained tokens/s), p50/p99 latency per call kind, and no cross-talk (every adapter after the concurrent run is
  bitwise equal to its run alone);
* sweep: 1, 4, 8, 16 concurrent sessions x `--sweep-updates` updates: throughput against the one-at-a-time
  throughput measured above, and Jain's fairness index over the sessions' own throughputs (samples / own wall).
The model is the tiny preset (random weights: the task's rewards are not the point here, the service is); the
server runs as `k3 serve` in a subprocess, the clients as threads of this process."""
from __future__ import annotations

import argparse
import contextlib
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
from k3.serverless.job import gspo_update  # noqa: E402


def job_config(seed: int) -> JobConfig:
    cfg = JobConfig()
    cfg.rollout.tasks_per_update, cfg.rollout.group_size, cfg.rollout.max_turn_tokens = 2, 4, 8
    cfg.rl.train_seed, cfg.rl.lora_rank = seed, 8
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


def run_client(url: str, seed: int, updates: int, lat: dict, lock: threading.Lock, out: dict) -> None:
    client = ServiceClient(url)
    Timed(client, lat, lock)
    cfg = job_config(seed)
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


def scenario(url: str, seeds: list[int], updates: int, concurrent: bool) -> dict:
    lat: dict[str, list[float]] = {}
    lock = threading.Lock()
    out: dict = {}
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    if concurrent:
        threads = [threading.Thread(target=run_client, args=(url, s, updates, lat, lock, out)) for s in seeds]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for s in seeds:
            run_client(url, s, updates, lat, lock, out)
    wall = time.perf_counter() - t0
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
            "_weights": {s: v["weights"] for s, v in out.items()}}


@contextlib.contextmanager
def served(config: Path, port: int):
    """`k3 serve --config config` in a subprocess until the block ends."""
    env = {**os.environ, "K3_CPU_THREADS": os.environ.get("K3_CPU_THREADS", "1")}
    proc = subprocess.Popen([sys.executable, "-m", "k3.cli", "serve", "--config", str(config)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"k3 serve exited: {proc.stderr.read().decode()[-2000:]}")
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--updates", type=int, default=5)
    ap.add_argument("--sweep", default="1,4,8,16")
    ap.add_argument("--sweep-updates", type=int, default=3)
    ap.add_argument("--out", default="serverless")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("K3_CPU_THREADS", "1")))
    with tempfile.TemporaryDirectory() as tmp:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # the server in its own process (`k3 serve`, as deployed): the clients' Python work here does not take
        # the server's GIL. 32 rows per packed forward/backward bound its autograd memory (~3 GB)
        (Path(tmp) / "serve.toml").write_text(f'port = {port}\ndata_dir = "{tmp}/data"\nmax_sessions = 64\n'
                                              f'max_batch_rows = 32\n')
        with served(Path(tmp) / "serve.toml", port) as url:
            scenario(url, [99], 1, concurrent=False)    # warm-up (first forwards allocate), not reported
            seeds = [100 + i for i in range(args.clients)]
            seq = scenario(url, seeds, args.updates, concurrent=False)
            print(f"one after another: {seq['wall_s']:.1f} s, {seq['samples_per_s']:.2f} samples/s", flush=True)
            conc = scenario(url, seeds, args.updates, concurrent=True)
            print(f"concurrent:        {conc['wall_s']:.1f} s, {conc['samples_per_s']:.2f} samples/s", flush=True)
            mismatched = [s for s in seeds if not all(torch.equal(seq["_weights"][s][k], conc["_weights"][s][k])
                                                      for k in seq["_weights"][s])]
            sweep = []
            for n in [int(x) for x in args.sweep.split(",")]:
                r = scenario(url, [1000 + i for i in range(n)], args.sweep_updates, concurrent=True)
                r.pop("_weights")
                r["speedup_vs_one_at_a_time"] = r["samples_per_s"] / seq["samples_per_s"]
                sweep.append(r)
                print(f"{n:>3} sessions: {r['samples_per_s']:.2f} samples/s "
                      f"({r['speedup_vs_one_at_a_time']:.2f}x one-at-a-time), Jain {r['jain_fairness']:.3f}",
                      flush=True)
    seq.pop("_weights")
    conc.pop("_weights")
    result = {**run_header("serverless", device="cpu", packages=("fastapi", "uvicorn", "httpx")),
              "note": "CPU figures (2-core shared dev box, tiny preset, loopback HTTP); samples = episodes sampled "
                      "(multi-turn), trained tokens = tokens with weight > 0 in forward_backward",
              "workload": {"tasks_per_update": 2, "group_size": 4, "max_turn_tokens": 8, "lora_rank": 8,
                           "loss": "gspo", "max_batch_rows": 32, "server": "k3 serve subprocess, 1 torch thread"},
              "one_after_another": seq, "concurrent": conc,
              "speedup_samples_per_s": conc["samples_per_s"] / seq["samples_per_s"],
              "speedup_trained_tokens_per_s": conc["trained_tokens_per_s"] / seq["trained_tokens_per_s"],
              "no_cross_talk": not mismatched, "mismatched_sessions": mismatched,
              "sweep": sweep}
    print(f"speedup {result['speedup_samples_per_s']:.2f}x samples/s; no cross-talk: {result['no_cross_talk']}")
    print(f"wrote {write_results(args.out, result)}")


if __name__ == "__main__":
    main()
