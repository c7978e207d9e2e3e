"""Shared utilities of the serverless tests: a tiny server config on a free loopback port, data builders."""
from __future__ import annotations

import dataclasses
import random
import socket

from k3.serverless import Datum, ModelInput
from k3.serverless.config import ServeConfig

VOCAB = 512   # the tiny preset's vocabulary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_config(data_dir, **changes) -> ServeConfig:
    base = ServeConfig(port=free_port(), data_dir=str(data_dir), max_rank=64, max_data=16, max_seq_len=96,
                       max_num_samples=8, max_sample_tokens=16, length_bucket=32)
    return dataclasses.replace(base, **changes)


def rand_datum(seed: int, n: int | None = None, loss_fn: str = "cross_entropy") -> Datum:
    rng = random.Random(seed)
    n = n or rng.randint(8, 60)
    toks = [rng.randrange(VOCAB) for _ in range(n + 1)]
    inputs: dict[str, list] = {"target_tokens": toks[1:], "weights": [0.0] * (n // 3) + [1.0] * (n - n // 3)}
    if loss_fn != "cross_entropy":
        inputs["logprobs"] = [-rng.uniform(4.0, 8.0) for _ in range(n)]
        adv = rng.uniform(-1, 1)
        inputs["advantages"] = [adv / n] * n
    return Datum(ModelInput.from_ints(toks[:-1]), inputs)
