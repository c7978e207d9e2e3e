"""The deterministic all-reduce on 2+ GPUs (NCCL group, torch symmetric memory, the Triton peer-sum kernels with
in-kernel meetings and with torch's host barrier): every rank's result equal bit for bit to the spec for sizes up to
25 MB, fp32 and bf16, one-shot / two-shot / auto, calls back to back. The CPU counterpart is test_comm.py (gloo
ranks, and the same kernels' stages and signal protocol in Triton's interpreter). Needs >= 2 GPUs; on a 2-GPU
machine: `. benchmarks/device_env.sh && python3 -m pytest -q tests/kernels/test_comm_gpu.py` (kernels/comm/NOTES.md)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _comm_workers import DTYPES, GPU_NUMELS, algorithms, run_gpu_battery  # noqa: E402
from _spawned_ranks import spawn_ranks  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason=(
    "needs >= 2 GPUs (a collective over symmetric memory; the CPU counterpart is tests/kernels/test_comm.py)"))]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    world = min(torch.cuda.device_count(), 8)
    d = tmp_path_factory.mktemp("comm_gpu")
    return spawn_ranks(run_gpu_battery, world, d)


@pytest.mark.parametrize("path", ["in_kernel", "host_barrier", "process_group"])
def test_every_rank_gets_the_spec_bits_on_gpus(ranks, path):
    bad = [(r, numel, dt, a) for r, res in enumerate(ranks) for numel in GPU_NUMELS for dt in map(str, DTYPES)
           for a in algorithms() if not res["ok"][(numel, dt, a, path)]]
    assert not bad, bad
