"""A token's bits must not depend on how many tokens of its row share the forward, on CPU: one [B, T] forward
from a state (a speculative chain verify of T <= 8 positions) gives the logits, KDA recurrent and conv states and
MLA latents of T one-token [B, 1] forwards (plain decoding), bit for bit. Why it exists: before, three ops broke it
(l2norm summed over the short conv's strided output, beta's sigmoid took ATen's scalar tail on [B, T, H], MLA ran
one [T, S] score GEMM, the router's sigmoid took the scalar tail on [N, experts]), so a batched verify was only
close to plain decoding. Checked under this machine's ATen ISA, AVX2 and the scalar default; on CUDA (`gpu`) in fp32
and bf16, where cuBLAS linears, cuDNN's conv and the batched attention einsums broke it (k3.model.ops now routes
inference through the batch-invariant GEMM, the fused KDA step inputs and the per-query MLA kernel).

The CPU counterparts of the CUDA-only pieces: the kernels' own tests under the interpreter
(tests/kernels/test_kda_step_inputs.py for the step inputs)."""
import os
import subprocess
import sys

import pytest
import torch

_SCRIPT = """
import os
import torch
from k3.config import K3Config
from k3.model import K3ForCausalLM
dev, dtype = os.environ.get("K3_DEVICE", "cpu"), getattr(torch, os.environ.get("K3_DTYPE", "float32"))
torch.manual_seed(0)
model = K3ForCausalLM(K3Config.preset("tiny")).eval()
with torch.no_grad():
    for p in model.parameters():   # non-trivial AttnRes projections and gates
        p.add_(0.05 * torch.randn_like(p))
model = model.to(dev, dtype)
bad = []
with torch.no_grad():
    for B, P, T in ((4, 20, 4), (3, 9, 8), (1, 33, 2), (2, 1, 5), (5, 47, 3), (2, 30, 16)):
        ids = torch.randint(3, 200, (B, P + T), device=dev)
        st = model(ids[:, :P]).state
        once = model(ids[:, P:], st)
        s, logits = st, []
        for t in range(T):
            o = model(ids[:, P + t:P + t + 1], s)
            s, logits = o.state, logits + [o.logits]
        if not torch.equal(once.logits, torch.cat(logits, 1)):
            bad.append((B, P, T, "logits"))
        for i, (la, lb) in enumerate(zip(once.state.layers, s.layers)):
            for f in ("recurrent", "conv", "c_kv", "k_pe"):
                if hasattr(la, f) and not torch.equal(getattr(la, f), getattr(lb, f)):
                    bad.append((B, P, T, i, f))
print("BAD", bad)
"""


@pytest.mark.parametrize("isa", [None, "avx2", "default"])
def test_verify_forward_is_bitwise_one_token_forwards(isa):
    env = dict(os.environ)
    if isa is not None:
        env["ATEN_CPU_CAPABILITY"] = isa
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "BAD []", out.stdout[-2000:]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verify_forward_is_bitwise_one_token_forwards_on_cuda(dtype):
    env = dict(os.environ, K3_DEVICE="cuda", K3_DTYPE=dtype)
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "BAD []", out.stdout[-2000:]
