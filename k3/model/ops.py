"""The one place that picks an op's implementation: Triton kernels for CUDA tensors when available,
the plain-torch references (k3_kernels.*.naive) otherwise. Every model op goes through here."""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from k3_kernels.attnres import naive_block_attnres
from k3_kernels.kda import naive_chunk_kda, naive_recurrent_kda
from k3_kernels.norm import naive_gated_rms_norm, naive_rms_norm
from k3_kernels.situ import naive_situ_and_mul


def _on_cuda(x: torch.Tensor) -> bool:
    return x.is_cuda


# CPU GEMMs take another code path for a handful of rows (and for some row-count tails), so a token's result
# would depend on how many tokens share the call (decode vs prefill, expert group sizes). Padding the row count
# to a multiple of 8 makes each row's result independent of the others (tests/model/test_ops.py checks it).
_ROW_MULTIPLE = 8


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-invariant x @ weight.T (+ bias) on CPU; plain F.linear on CUDA."""
    if x.is_cuda:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    pad = (-rows.shape[0]) % _ROW_MULTIPLE
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    out = F.linear(rows, weight, bias)
    if pad:
        out = out[: out.shape[0] - pad]
    return out.reshape(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """nn.Linear (same parameter names) computed through the batch-invariant `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


CPU_KDA_CHUNK = 16


def kda_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              initial_state: torch.Tensor | None = None, output_final_state: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Multi-token KDA (prefill / training). q, k already L2-normalised; g log-decay; beta in (0, 1)."""
    if _on_cuda(q):  # Triton chunked kernels, forward and backward
        from k3_kernels.kda.chunk import chunk_kda
        h0 = initial_state.float() if initial_state is not None else None  # the kernels keep the state in fp32
        return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=output_final_state)
    # 16-token chunks: K3's safe gate (>= -5 per token) keeps the reference on its two-matmul path
    return naive_chunk_kda(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                           chunk_size=CPU_KDA_CHUNK)


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  initial_state: torch.Tensor | None = None, output_final_state: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Few-token KDA (decode)."""
    if _on_cuda(q):  # Triton token loop (forward only); the chunked kernels when gradients are needed
        if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, g, beta)):
            return kda_chunk(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state)
        from k3_kernels.kda.fused_recurrent import fused_recurrent_kda
        h0 = initial_state.float() if initial_state is not None else None
        return fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=output_final_state)
    return naive_recurrent_kda(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    if _on_cuda(x):  # batch-invariant Triton kernel
        from k3_kernels.norm.fused import rms_norm as fused_rms_norm
        return fused_rms_norm(x, weight, eps)
    return naive_rms_norm(x, weight, eps)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    if _on_cuda(x):
        from k3_kernels.norm.fused import gated_rms_norm as fused_gated_rms_norm
        return fused_gated_rms_norm(x, gate, weight, eps)
    return naive_gated_rms_norm(x, gate, weight, eps)


def situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    if _on_cuda(gate):
        from k3_kernels.situ.fused import situ_and_mul as fused_situ_and_mul
        return fused_situ_and_mul(gate, up, beta, linear_beta)
    return naive_situ_and_mul(gate, up, beta, linear_beta)


def block_attnres(rows: Sequence[torch.Tensor], partial: torch.Tensor, query: torch.Tensor,
                  norm_weight: torch.Tensor, eps: float, output_norm_weight: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """K3 block AttnRes; `output_norm_weight` fuses the following RMSNorm (applied to the rounded mixture)."""
    if _on_cuda(partial):  # fused Triton kernel: rows read in place, gradients accumulated into their buffers
        from k3_kernels.attnres.fused import fused_block_attnres
        return fused_block_attnres(rows, partial, query, norm_weight, eps, output_norm_weight)
    return naive_block_attnres(rows, partial, query, norm_weight, eps, output_norm_weight)


def attnres_bank_row(x: torch.Tensor) -> torch.Tensor:
    """What to store in the AttnRes bank for block row `x`: on CUDA under autograd, an alias whose gradients from
    all AttnRes consumers accumulate in one buffer (no per-consumer gradient tensors); `x` itself otherwise."""
    if _on_cuda(x):
        from k3_kernels.attnres.fused import attnres_grad_sink
        return attnres_grad_sink(x)
    return x
