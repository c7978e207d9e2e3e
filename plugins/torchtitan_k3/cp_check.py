"""One MLA layer under context parallelism against the same layer unsharded, on spawned gloo ranks: the exactness
check (forward outputs, input and parameter gradients) and the work count (score elements each rank's attention
computes) of `CPGatedMLA` (load-balanced) and `ContiguousCPGatedMLA`. Shared by the tests and
benchmarks/torchtitan_parity.py, so the JSON's figures come from the code CI checks."""
from __future__ import annotations

import json
import os
import socket
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3.config import K3Config
from k3.model import ops
from k3.model.mla import GatedMLA
from k3.model.state import DenseCache

from .context_parallel import ContiguousCPGatedMLA, CPGatedMLA

VARIANTS = {"balanced": CPGatedMLA, "contiguous": ContiguousCPGatedMLA}


@dataclass(frozen=True)
class MLACheck:
    cp: int
    seq_len: int
    variant: str
    max_abs_out: float            # |CP - unsharded| over the layer outputs
    max_abs_grad_x: float         # ... over the input gradients
    max_abs_grad_params: float    # ... over the parameter gradients (summed over ranks)
    ref_abs_out: float            # max |unsharded| of each, the scale of the differences
    ref_abs_grad_x: float
    ref_abs_grad_params: float
    score_elements: list[int]     # per rank, per batch row and head: sum over attention calls of queries x keys


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, seq_len: int, variant: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = K3Config.preset("tiny")
        torch.manual_seed(0)
        layer = GatedMLA(cfg).double()
        x = torch.randn(2, seq_len, cfg.hidden_size, dtype=torch.float64)
        w = torch.randn(2, seq_len, cfg.hidden_size, dtype=torch.float64)
        xr = x.clone().requires_grad_(True)
        # the unsharded layer as k3.model's training forward runs it (a cache view that stores nothing)
        ref = layer(xr, DenseCache(None, 1, 2, xr.device, store=False), 0)
        (ref * w).sum().backward()
        ref_grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
        layer.zero_grad()
        t = seq_len // world
        local = x[:, rank * t:(rank + 1) * t].clone().requires_grad_(True)
        layer.__class__ = VARIANTS[variant]
        layer.cp_group = dist.group.WORLD
        counted: list[int] = []
        attention = ops.mla_attention

        def counting(q_nope, q_pe, k_nope, k_pe, v, past, scale):
            counted.append(q_nope.shape[1] * k_nope.shape[1])
            return attention(q_nope, q_pe, k_nope, k_pe, v, past, scale)

        ops.mla_attention = counting
        try:
            got = layer(local, None, 0)
            (got * w[:, rank * t:(rank + 1) * t]).sum().backward()
        finally:
            ops.mla_attention = attention
        grads = torch.cat([p.grad.reshape(-1) for _, p in layer.named_parameters()])
        dist.all_reduce(grads)
        outs = [torch.empty_like(got) for _ in range(world)]
        dist.all_gather(outs, got.detach().contiguous())
        gx = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gx, local.grad.contiguous())
        work = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
        dist.all_gather(work, torch.tensor([sum(counted)]))
        if rank == 0:
            ref_flat = torch.cat([ref_grads[n].reshape(-1) for n, _ in layer.named_parameters()])
            check = MLACheck(cp=world, seq_len=seq_len, variant=variant,
                             max_abs_out=float((torch.cat(outs, 1) - ref.detach()).abs().max()),
                             max_abs_grad_x=float((torch.cat(gx, 1) - xr.grad).abs().max()),
                             max_abs_grad_params=float((grads - ref_flat).abs().max()),
                             ref_abs_out=float(ref.detach().abs().max()), ref_abs_grad_x=float(xr.grad.abs().max()),
                             ref_abs_grad_params=float(ref_flat.abs().max()), score_elements=[int(c) for c in work])
            Path(out).write_text(json.dumps(asdict(check)))
    finally:
        dist.destroy_process_group()


def check_mla(cp: int, seq_len: int, variant: str = "balanced") -> MLACheck:
    """Spawn `cp` gloo ranks. The layer's parameters and inputs are fp64, but `ops.mla_attention` computes in fp32
    (as in training), so the differences are fp32 rounding of the reordered sums."""
    if variant not in VARIANTS:
        raise ValueError(f"variant: unknown {variant!r}; choose from {sorted(VARIANTS)}")
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len: {seq_len} is not divisible by 2 x cp ({2 * cp})")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "check.json")
        mp.spawn(_rank_main, args=(cp, _free_port(), seq_len, variant, out), nprocs=cp, join=True)
        return MLACheck(**json.loads(Path(out).read_text()))
