"""The one place that picks an op's implementation: Triton kernels for CUDA tensors when available,
the plain-torch references (k3_kernels.*.naive) otherwise. Every model op goes through here."""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from k3_kernels.attnres import naive_block_attnres
from k3_kernels.fp8_linear.naive import MAX_ROWS as FP8_LINEAR_MAX_ROWS, naive_fp8_weight_linear
from k3_kernels.kda import naive_chunk_kda, naive_kda_step_inputs, naive_recurrent_kda
from k3_kernels.lora import naive_multi_lora
from k3_kernels.moe import naive_dequant_mxfp4
from k3_kernels.norm import naive_gated_rms_norm, naive_rms_norm
from k3_kernels.situ import naive_situ_and_mul


def _on_cuda(x: torch.Tensor) -> bool:
    return x.is_cuda


# A CPU GEMM picks its code path by shape (and by CPU: MKL's AVX-512/AMX kernels differ from its AVX2 ones, AMD's
# Zen 4 from Intel's): a token's result would depend on how many tokens share the call (decode vs prefill, expert
# group sizes, packed multi-session training), and on some CPUs even a padded single call is not enough (one row of 8
# and the same row among 304 differ for narrow outputs). So on CPU every linear cuts the rows into blocks of a fixed
# size and multiplies every block with the same batched GEMM of one shape: each row's result depends only on its own
# values (tests/model/test_ops.py checks it over shapes, offsets and counts). Training forwards take the same path,
# so the learner's log-probs are the rollout's bits (tests/rl/test_learner.py); their backward gives the input
# gradient the same way (a packed multi-session step gives each session its bits alone, k3.serverless.compute)
# and the weight gradient as one plain GEMM over the rows (deterministic for the same shapes).
_ROW_BLOCK = 16


def _recorded(*xs: torch.Tensor) -> bool:
    """Autograd records this op (a training forward)."""
    return torch.is_grad_enabled() and any(x.requires_grad for x in xs)


def _row_block_linear(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rows [m, in] @ weight.T, every block of _ROW_BLOCK rows through one batched GEMM of the same shape."""
    m = rows.shape[0]
    if not m:
        return rows.new_zeros(0, weight.shape[0])
    pad = (-m) % _ROW_BLOCK
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    blocks = rows.shape[0] // _ROW_BLOCK
    out = torch.bmm(rows.view(blocks, _ROW_BLOCK, -1), weight.t().unsqueeze(0).expand(blocks, -1, -1))
    return out.reshape(-1, weight.shape[0])[:m]


class _RowBlockLinear(torch.autograd.Function):
    """rows @ weight.T by row blocks (forward and input gradient); the weight gradient as one GEMM."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows, weight)
        return _row_block_linear(rows, weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        rows, weight = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_rows = _row_block_linear(grad_out, weight.t()) if ctx.needs_input_grad[0] else None
        grad_weight = grad_out.t() @ rows if ctx.needs_input_grad[1] else None
        return grad_rows, grad_weight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-invariant x @ weight.T (+ bias): on CPU by row blocks (training too); on CUDA inference through
    k3_kernels.batch_invariant (one fixed-tile Triton GEMM: a decode step's row and the same token in a [B, k+1]
    speculative verify get the same bits), CUDA training forwards through cuBLAS (F.linear)."""
    if x.is_cuda:
        if _recorded(x, weight) or x.dtype != weight.dtype:
            return F.linear(x, weight, bias)
        from k3_kernels.batch_invariant import batch_invariant_linear
        return batch_invariant_linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    out = _RowBlockLinear.apply(rows, weight) if _recorded(rows, weight) else _row_block_linear(rows, weight)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """nn.Linear (same parameter names) computed through the batch-invariant `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def _mla_scores_and_mix(q_nope, q_pe, k_nope, k_pe, v, past, scale):
    B, T = q_nope.shape[:2]
    S = k_nope.shape[1]
    scores = torch.einsum("bthd,bshd->bhts", q_nope.float(), k_nope.float())
    scores = scores + torch.einsum("bthd,bsd->bhts", q_pe.float(), k_pe.float())
    # query t of row b sees keys j <= past_b + t (its own past, then the new tokens causally)
    limit = past.view(B, 1, 1) + torch.arange(T, device=q_nope.device).view(1, T, 1)
    visible = torch.arange(S, device=q_nope.device).view(1, 1, S) <= limit
    scores = (scores * scale).masked_fill(~visible[:, None], float("-inf"))
    return torch.einsum("bhts,bshd->bthd", torch.softmax(scores, dim=-1), v.float())


# Up to this many new tokens per row (decode, any chain or tree verify: the pending token and <= 15 drafts) attention
# runs query by query, each over exactly its visible keys: a query's bits are then those of a one-token (decode)
# call at its position, which a [T, S] score GEMM's are not (its code path depends on T). CPU: a loop of one-query
# calls; CUDA inference: k3_kernels.mla_decode's per-query kernel. Longer prefills (and CUDA training) batched.
PER_QUERY_MAX_TOKENS = 16


def _cuda_per_query(q: torch.Tensor, *kv: torch.Tensor) -> bool:
    return _on_cuda(q) and q.shape[1] <= PER_QUERY_MAX_TOKENS and not _recorded(q, *kv)


def _query_alone(q_nope, q_pe, k_nope, k_pe, v, b: int, t: int, keys, scale: float) -> torch.Tensor:
    """Query t of row b as a one-token call over row b's keys `keys` (a slice or an index tensor, in position
    order) -> [1, 1, H, v_dim]: the shapes, hence the bits, of decoding that token."""
    kn = k_nope[b:b + 1, keys]
    past = torch.full((1,), kn.shape[1] - 1, dtype=torch.long)
    return _mla_scores_and_mix(q_nope[b:b + 1, t:t + 1], q_pe[b:b + 1, t:t + 1], kn, k_pe[b:b + 1, keys],
                               v[b:b + 1, keys], past, scale)


def mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor,
                  v: torch.Tensor, past: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal MLA attention in fp32 -> [B, T, H, v_dim]. Row b's T queries follow its `past[b]` cached keys; keys
    past a row's own length (padding to the batch's longest row) are invisible.

    On CPU each row is computed alone over exactly its own keys: the batched contractions' CPU GEMMs pick their
    code path by batch count and key length, so a row's result would depend on its companions (decode batches);
    up to PER_QUERY_MAX_TOKENS new tokens, each query alone (a verify's token gets its decode bits).
    Training forwards take the same path, as `linear` does: the learner's log-probs are the rollout's bits.
    On CUDA, decode and verify-sized calls (inference) run each query over its own keys in the per-query kernel."""
    if _cuda_per_query(q_nope, k_nope, v):
        from k3_kernels.mla_decode import causal_key_index, query_attention
        index, count = causal_key_index(past.to(q_nope.device), q_nope.shape[1], k_nope.shape[1])
        return query_attention(q_nope, q_pe, k_nope, k_pe, v, index, count, scale)
    if _on_cuda(q_nope):
        return _mla_scores_and_mix(q_nope, q_pe, k_nope, k_pe, v, past, scale)
    T = q_nope.shape[1]
    rows = []
    for b in range(q_nope.shape[0]):
        n = int(past[b]) + T
        if T <= PER_QUERY_MAX_TOKENS:
            rows.append(torch.cat([_query_alone(q_nope, q_pe, k_nope, k_pe, v, b, t, slice(0, n - T + t + 1), scale)
                                   for t in range(T)], 1))
        else:
            rows.append(_mla_scores_and_mix(q_nope[b:b + 1], q_pe[b:b + 1], k_nope[b:b + 1, :n], k_pe[b:b + 1, :n],
                                            v[b:b + 1, :n], past[b:b + 1], scale))
    return torch.cat(rows)


def mla_masked_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor,
                         v: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """MLA attention in fp32 under an explicit mask visible [B, T, S] (query t of row b sees key s) -> [B, T, H, V]
    (a token-tree verify). On CPU each query alone over exactly its visible keys in position order (a tree node:
    the prefix, then its ancestors; a verify has at most 16 positions): the bits plain decoding computes for it."""
    visible = visible.to(q_nope.device)
    if _cuda_per_query(q_nope, k_nope, v):   # each node over the prefix, then its ancestors (decode's key order)
        from k3_kernels.mla_decode import mask_key_index, query_attention
        index, count = mask_key_index(visible)
        return query_attention(q_nope, q_pe, k_nope, k_pe, v, index, count, scale)
    if _on_cuda(q_nope):
        scores = torch.einsum("bthd,bshd->bhts", q_nope.float(), k_nope.float())
        scores = scores + torch.einsum("bthd,bsd->bhts", q_pe.float(), k_pe.float())
        scores = (scores * scale).masked_fill(~visible[:, None], float("-inf"))
        return torch.einsum("bhts,bshd->bthd", torch.softmax(scores, dim=-1), v.float())
    B, T = q_nope.shape[:2]
    return torch.cat([torch.cat([_query_alone(q_nope, q_pe, k_nope, k_pe, v, b, t, visible[b, t].nonzero().flatten(),
                                              scale) for t in range(T)], 1) for b in range(B)])


# Set to True (tests) to run the fused KDA step inputs (k3_kernels.kda.step_inputs) on CPU tensors too, in Triton's
# interpreter: the CPU counterpart of the CUDA engine's composition (decode, verify and commit all through it).
KDA_STEP_KERNEL_ON_CPU = False


def kda_step_kernel(x: torch.Tensor) -> bool:
    """Whether KDA's step inputs of x's device go through the one-launch kernel in inference (`kda_step_inputs`):
    a token's bits are then the same whatever the call holds, so a speculative commit may rebuild every accepted
    position in one call."""
    return _on_cuda(x) or KDA_STEP_KERNEL_ON_CPU


def kda_step_inputs(xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
                    windows: torch.Tensor | None, conv_weights: tuple[torch.Tensor, ...], A_log: torch.Tensor,
                    dt_bias: torch.Tensor, lower_bound: float | None, eps: float = 1e-6, with_q: bool = True,
                    roll: torch.Tensor | None = None):
    """KDA's q, k, v, g, beta and rolled short-conv windows from its projections (k3_kernels.kda.naive_kda_step_inputs
    is the spec). CUDA inference: one Triton launch a layer (`fused_kda_step_inputs`: a token's bits are the same
    whether the call holds 1 token, a verify's k+1 or a prefill; the torch composition is ~50 launches, and cuDNN's
    conv picks its algorithm by the input's length). Otherwise the spec (the CPU conv is per token already,
    tests/model/test_verify_shapes.py; CUDA training keeps cuDNN and autograd)."""
    if kda_step_kernel(xk) and not _recorded(xq, xk, xv, f, b, *conv_weights, A_log, dt_bias):
        from k3_kernels.kda.step_inputs import fused_kda_step_inputs
        return fused_kda_step_inputs(xq, xk, xv, f, b, windows, conv_weights, A_log, dt_bias, lower_bound, eps,
                                     with_q, roll)
    return naive_kda_step_inputs(xq, xk, xv, f, b, windows, conv_weights, A_log, dt_bias, lower_bound, eps, with_q,
                                 roll)


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


def kda_replay_commit(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      n_accept: torch.Tensor, n_accept_checked: bool = False) -> torch.Tensor:
    """ReplaySSM commit (speculative decoding): fold each row's first n_accept[b] stored step inputs
    (k, v, g, beta: [T, B, ...]) into its committed state [B, HV, K, V] fp32 -> the state decode would reach. CUDA:
    the Triton fold, op for op the decode kernel's state update (`n_accept_checked`: its range was checked on the
    host, no device read-back); CPU: the reference (decode's own step)."""
    if _on_cuda(state):
        from k3_kernels.replay_ssm.replay import replay_commit
        return replay_commit(state, k, v, g, beta, n_accept, n_accept_checked)
    from k3_kernels.replay_ssm.naive import naive_replay_commit
    return naive_replay_commit(state, k, v, g, beta, n_accept)


def kda_replay_commit_into(store: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           g: torch.Tensor, beta: torch.Tensor, n_accept: torch.Tensor, checked: bool = False) -> None:
    """`kda_replay_commit` of the pool rows store[rows[b]] ([N, HV, K, V] fp32), written back in place (rows with
    n_accept 0 untouched): CUDA, the Triton fold reading and writing the pool once (`checked`: rows and n_accept
    built and checked on the host, no device read-back); CPU, the reference."""
    if _on_cuda(store):
        from k3_kernels.replay_ssm.replay import replay_commit_into
        return replay_commit_into(store, rows, k, v, g, beta, n_accept, checked)
    from k3_kernels.replay_ssm.naive import naive_replay_commit_into
    return naive_replay_commit_into(store, rows, k, v, g, beta, n_accept)


# Set to True (tests) to run the multi-LoRA kernels (k3_kernels.lora) on CPU tensors too, in Triton's interpreter.
LORA_KERNELS_ON_CPU = False


def fused_multi_lora(x: torch.Tensor) -> bool:
    """Whether multi-LoRA rows of x's device go through `multi_lora` (adapters stacked, one shrink/expand pair per
    projection) instead of k3.lora.LoRAManager's per-adapter torch loop, which stays the CPU path (bit for bit)."""
    return _on_cuda(x) or LORA_KERNELS_ON_CPU


def multi_lora(x: torch.Tensor, base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor,
               scale: torch.Tensor) -> torch.Tensor:
    """base + per-token LoRA over stacked adapters (k3_kernels.lora's spec): x [N, in], base [N, out],
    A [S, r, in], B [S, out, r], slots [N] (-1 = none), scale [S]; differentiable in x, base, A and B.
    CUDA: the SGMV/BGMV Triton kernels (deterministic, a row depends only on itself); elsewhere the reference."""
    if _on_cuda(x) or LORA_KERNELS_ON_CPU:
        from k3_kernels.lora.sgmv import sgmv_lora
        return sgmv_lora(x, base, lora_a, lora_b, slots, scale)
    return naive_multi_lora(x, base, lora_a, lora_b, slots, scale)


def multi_lora_per_token(x: torch.Tensor, base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                         slots: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`multi_lora` for inference with no host read of the slots (a captured forward's, k3.rollout.graphs): CUDA:
    BGMV (one segment a token, built on the device; a row's bits are `multi_lora`'s); elsewhere the reference."""
    if _on_cuda(x) or LORA_KERNELS_ON_CPU:
        from k3_kernels.lora.sgmv import bgmv_lora
        return bgmv_lora(x, base, lora_a, lora_b, slots, scale)
    return naive_multi_lora(x, base, lora_a, lora_b, slots, scale)


# Set to True (tests) to run the fused MoE kernels (k3_kernels.moe) on CPU tensors too, in Triton's interpreter.
MOE_KERNELS_ON_CPU = False


def fused_moe(x: torch.Tensor) -> bool:
    """Whether the latent MoE's router and routed experts on x's device go through `moe_router` / `moe_experts`
    (k3_kernels.moe: fused router, grouped GEMMs, deterministic and batch-invariant) instead of k3.model.moe's
    torch code, which stays the CPU path (bit for bit)."""
    return _on_cuda(x) or MOE_KERNELS_ON_CPU


def moe_router(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool,
               scaling: float, forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """noaux_tc routing -> (expert ids [N, k] int64, weights [N, k] fp32): the fused Triton router (ties to the
    lowest id; `forced` rows replayed, rows of -1 routed freely)."""
    from k3_kernels.moe.router import fused_router
    return fused_router(x, weight, bias, top_k, renormalize, scaling, forced)


def moe_experts(z: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                w2: torch.Tensor, beta: float, linear_beta: float, ids_checked: bool = False) -> torch.Tensor:
    """sum_j w[t, j] E_{idx[t, j]}(z[t]) on the grouped-GEMM kernels (bf16; forward and backward). `ids_checked`:
    the ids are known to lie in [0, E) (not read back: no host sync)."""
    from k3_kernels.moe.layer import moe_experts as fused_moe_experts
    return fused_moe_experts(z, idx, w, w1, w3, w2, beta, linear_beta, ids_checked=ids_checked)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
                     ) -> torch.Tensor:
    """MXFP4 (compressed-tensors `mxfp4-pack-quantized`: packed uint8 [out, in / 2], E8M0 scales [out, in / 32])
    -> dtype [out, in], exact; the checkpoint loader's path for routed experts. CUDA: the Triton kernel."""
    if _on_cuda(packed):
        from k3_kernels.moe.quant import dequantize_mxfp4 as triton_dequantize_mxfp4
        return triton_dequantize_mxfp4(packed, scales, dtype)
    return naive_dequant_mxfp4(packed, scales, dtype)


# Set to True (tests) to run the weight-only FP8 linear (k3_kernels.fp8_linear) on CPU tensors too, in Triton's
# interpreter.
FP8_LINEAR_KERNEL_ON_CPU = False


def fp8_weight_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ (q [N, K] e4m3 * scale [N] per row).T -> [..., N] in x's dtype, for a few rows (the trained draft
    head's steps). CUDA: the Triton kernel (half a bf16 weight's bytes); CPU: the spec."""
    if (_on_cuda(x) or FP8_LINEAR_KERNEL_ON_CPU) and x.numel() // max(x.shape[-1], 1) <= FP8_LINEAR_MAX_ROWS:
        from k3_kernels.fp8_linear import fp8_weight_linear as triton_fp8_weight_linear
        return triton_fp8_weight_linear(x, q, scale)
    return naive_fp8_weight_linear(x, q, scale)
