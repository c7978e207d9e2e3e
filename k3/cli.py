"""`k3` command line: `k3 demo` (decode demo + parameter counts), `k3 sft`, `k3 rl`, `k3 serve`.

`sft` and `rl` load and check their whole job config first, before torch is imported: any config error is one
line `k3 <cmd>: bad config: <field>: <why>` on stderr and exit code 2, never a traceback after minutes of work."""
from __future__ import annotations

import argparse
import os
import sys
import time
import tomllib
from pathlib import Path

from k3.jobs.config import JobConfig, JobConfigError, load_config


def _demo(args: argparse.Namespace) -> int:
    import torch

    from k3.config import K3Config
    from k3.model import K3ForCausalLM, count_parameters

    print(f"{'preset':<8}{'total params':>18}{'active params':>18}")
    for name in ("tiny", "small", "k3"):
        c = count_parameters(K3Config.preset(name))
        print(f"{name:<8}{c['total']:>18,}{c['active']:>18,}")
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = K3ForCausalLM(K3Config.preset("tiny")).to(device).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_len), device=device)
    with torch.no_grad():
        t0 = time.perf_counter()
        logits, state = model.extend(prompt)
        t1 = time.perf_counter()
        tokens = []
        nxt = logits[:, -1:].argmax(-1)
        for _ in range(args.new_tokens):
            tokens.append(int(nxt))
            logits, state = model.extend(nxt, state)
            nxt = logits[:, -1:].argmax(-1)
        t2 = time.perf_counter()
    print(f"tiny model on {device}: prefill {args.prompt_len} tokens {args.prompt_len / (t1 - t0):,.0f} tok/s; "
          f"greedy decode {args.new_tokens} tokens {args.new_tokens / (t2 - t1):,.1f} tok/s")
    print("decoded:", tokens)
    return 0


def _overrides(args: argparse.Namespace) -> dict:
    """`--set section.field=value` pairs; values parse as TOML (numbers, booleans, quoted strings) or bare strings.
    A pair without "=" is a JobConfigError naming the field (the field names themselves are checked by
    load_config)."""
    out = {}
    for item in args.set or []:
        key, eq, value = item.partition("=")
        if not eq:
            raise JobConfigError(f"{item or '(empty)'}: --set needs SECTION.FIELD=VALUE, got {item!r}")
        try:
            out[key.strip()] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = value
    return out


def _cpu_threads() -> int:
    """The intra-op thread count for CPU runs: one unless K3_CPU_THREADS says otherwise. The tiny model's many
    small ops run faster without a thread pool (measured: ~3.5x per SFT step on 2 busy cores), and results do not
    depend on how a reduction was split across threads. Read (and checked) with the config, before any work."""
    text = os.environ.get("K3_CPU_THREADS", "1")
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise JobConfigError(f"K3_CPU_THREADS: must be a positive integer, got {text!r}")
    return n


def _apply_cpu_threads(n: int) -> None:
    import torch

    if not torch.cuda.is_available():
        torch.set_num_threads(n)


def _load(args: argparse.Namespace) -> JobConfig:
    """The job config of `k3 sft` / `k3 rl` (file, then --set, then --updates), every field checked; and the
    other inputs a run would trip over later (K3_CPU_THREADS, --out)."""
    overrides = _overrides(args)
    if getattr(args, "updates", None) is not None:
        overrides["updates"] = args.updates
    cfg = load_config(args.config, overrides)
    args.threads = _cpu_threads()
    out = getattr(args, "out", None)
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise JobConfigError(f"--out: {out} exists and is not a directory")
    return cfg


def _sft(args: argparse.Namespace, cfg: JobConfig) -> int:
    from k3.jobs.sft import ensure_base

    _apply_cpu_threads(args.threads)
    path, trained = ensure_base(cfg)
    print(f"SFT base {'trained and saved' if trained else 'found (cached)'}: {path}")
    return 0


def _train_drafter(args: argparse.Namespace, cfg: JobConfig) -> int:
    from k3.rollout.spec.train_drafter import ensure_drafter

    _apply_cpu_threads(args.threads)
    path, trained = ensure_drafter(cfg)
    print(f"drafter {'trained and saved' if trained else 'found (cached)'}: {path}  "
          f"(use: --set rollout.speculative=drafter:3)")
    return 0


def _rl(args: argparse.Namespace, cfg: JobConfig) -> int:
    _apply_cpu_threads(args.threads)
    if getattr(args, "serverless", None):  # the same GSPO loop through a `k3 serve` service
        from k3.serverless.job import run_serverless_rl

        try:
            run_serverless_rl(cfg, args.serverless, Path(args.out), api_key=os.environ.get("K3_SERVE_KEY"))
        except ConnectionError as e:
            print(f"k3 rl: {e}", file=sys.stderr)
            return 2
        return 0
    from k3.jobs.rl import run_rl

    run_rl(cfg, Path(args.out))
    return 0


def _serve(args: argparse.Namespace) -> int:
    """`k3 serve`: the serverless multi-LoRA training service (k3.serverless); settings checked before start."""
    from k3.serverless.config import ServeConfig

    try:
        threads = _cpu_threads()
        cfg = ServeConfig.from_toml(args.config, host=args.host, port=args.port, data_dir=args.data_dir)
    except (JobConfigError, ValueError, OSError, tomllib.TOMLDecodeError) as e:
        print(f"k3 serve: bad config: {e}", file=sys.stderr)
        return 2
    _apply_cpu_threads(threads)
    from k3.serverless.server import serve

    serve(cfg)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="k3", description="Kimi K3 RL system")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("demo", help="prefill + greedy decode with the tiny model; parameter counts of every preset")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=_demo)
    for name, fn, text in (("sft", _sft, "warm start: train (or find cached) the SFT base of the calculator task"),
                           ("rl", _rl, "GSPO (LoRA or full) on the multi-turn calculator task, end to end"),
                           ("train-drafter", _train_drafter, "speculative decoding: train (or find cached) the "
                            "EAGLE3-style draft head on the SFT base's own calculator rollouts")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--config", default=None, help="TOML job config (defaults if omitted)")
        p.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE", help="override a config field")
        if name == "rl":
            p.add_argument("--updates", type=int, default=None)
            p.add_argument("--out", default="runs/rl")
            p.add_argument("--serverless", default=None, metavar="URL",
                           help="run the GSPO loop through a `k3 serve` service at URL (key: $K3_SERVE_KEY)")
        p.set_defaults(fn=fn)
    p = sub.add_parser("serve", help="serverless multi-LoRA training service (Tinker-shaped HTTP API)")
    p.add_argument("--config", default=None, help="TOML file of k3.serverless.ServeConfig fields")
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--data-dir", default=None, help="SQLite + safetensors state (sessions survive restarts)")
    p.set_defaults(fn=_serve)
    args = parser.parse_args(argv)
    if args.cmd in ("demo", "serve"):
        return args.fn(args)
    try:
        cfg = _load(args)  # everything checked before the job starts (SFT alone takes minutes)
    except JobConfigError as e:
        print(f"k3 {args.cmd}: bad config: {e}", file=sys.stderr)
        return 2
    return args.fn(args, cfg)


if __name__ == "__main__":
    sys.exit(main())
