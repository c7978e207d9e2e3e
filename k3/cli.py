"""`k3` command line: `k3 demo` (decode demo + parameter counts), more subcommands as the system grows."""
from __future__ import annotations

import argparse
import sys
import time

import torch


def _demo(args: argparse.Namespace) -> int:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="k3", description="Kimi K3 RL system")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("demo", help="prefill + greedy decode with the tiny model; parameter counts of every preset")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=_demo)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
