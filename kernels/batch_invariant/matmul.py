"""x [..., K] @ weight [N, K].T (+ bias) in one Triton kernel whose every output element is reduced in the same
order whatever the number of rows: one fixed tile configuration per (device, dtype), never chosen by M; every
program walks the whole of K in BLOCK_K steps from k = 0 (no split-K, no stream-K, no atomics); the row count is
not specialised on (`do_not_specialize`), so M = 1 and M = 4096 run the same compiled kernel. A configuration may
split K into a fixed number of ranges (`split_k`, chosen by the weight's shape like the tiles: narrow outputs have
too few output tiles to keep the GPU's memory busy at decode sizes): each range is reduced in order into an fp32
partial, and a second kernel adds the partials in range order -- still one fixed order per output element. cuBLAS picks its
kernel and split-K by M, so a token's logits in a [B, k+1] speculative verify differ from plain decoding's [B, 1]
in the last bits; with every projection through this kernel they do not (the approach of Thinking Machines'
batch_invariant_ops, 2025: fixed reduction order per output element). Spec: naive.py."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from k3_kernels.launch import cdiv


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1    # K ranges reduced by separate programs, then added in range order (a fixed split)


def config_for(device: torch.device, dtype: torch.dtype, N: int, K: int) -> MatmulConfig:
    """The one tile configuration of a (device, dtype, weight shape): chosen by the weight, never by the row count
    (that is the batch invariance). `benchmarks/batch_invariant.py --sweep` times the candidates against cuBLAS;
    small tiles under the interpreter."""
    if device.type != "cuda":
        return MatmulConfig(16, 32, 32, 4, 1)
    if dtype == torch.float32:
        return MatmulConfig(64, 64, 32, 4, 2)
    # 16-bit, by the sweep on the H200 (benchmarks/results/batch_invariant_sweep_h200.json, `sweep_ms`): the
    # candidate with the best mean ratio to the fastest over 1..512 rows at K3's projections
    if N >= 65536 or K <= 2048:     # the lm_head; short reductions into wide outputs (q_b, kv_b)
        return MatmulConfig(128, 128, 64, 8, 3)
    if N <= 4096:                   # narrow outputs (q_a, kv_a, the MoE latent): more programs along N
        return MatmulConfig(64, 32, 128, 4, 4)
    if N < K:                       # o_proj 12288 -> 7168
        return MatmulConfig(64, 64, 64, 4, 6)
    return MatmulConfig(64, 128, 64, 4, 4)


@triton.jit
def _reduce_k(x, w, rm, rn, mm, nm, k_lo, k_hi, K, stride_xm, stride_wn, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] = rows rm of x times rows rn of w over k in [k_lo, k_hi) (< K), in BLOCK_K steps from
    k_lo: every element k_lo, k_lo + BLOCK_K, ... in this order."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        km = rk < K
        a = tl.load(x + rm[:, None] * stride_xm + rk[None, :], mask=mm[:, None] & km[None, :], other=0.)
        b = tl.load(w + rn[None, :].to(tl.int64) * stride_wn + rk[:, None], mask=km[:, None] & nm[None, :],
                    other=0.)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit(do_not_specialize=["M"])
def _matmul(x, w, bias, out, M, N, K, stride_xm, stride_wn, stride_om, HAS_BIAS: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mm, nm = rm < M, rn < N
    acc = _reduce_k(x, w, rm, rn, mm, nm, 0, K, K, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=nm, other=0.).to(tl.float32)[None, :]
    tl.store(out + rm[:, None] * stride_om + rn[None, :], acc.to(out.dtype.element_ty), mask=mm[:, None] & nm[None, :])


@triton.jit(do_not_specialize=["M"])
def _matmul_split(x, w, part, M, N, K, K_RANGE, stride_xm, stride_wn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """Range `program_id(2)` of K ([s K_RANGE, (s + 1) K_RANGE), K_RANGE a multiple of BLOCK_K) -> fp32 partial
    part[s] [M, N], in BLOCK_K steps from the range's start."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mm, nm = rm < M, rn < N
    k_start = pid_s * K_RANGE
    acc = _reduce_k(x, w, rm, rn, mm, nm, k_start, k_start + K_RANGE, K, stride_xm, stride_wn, BLOCK_M, BLOCK_N,
                    BLOCK_K, PRECISION)
    base = pid_s.to(tl.int64) * M * N
    tl.store(part + base + rm[:, None] * N + rn[None, :], acc, mask=mm[:, None] & nm[None, :])


@triton.jit(do_not_specialize=["M"])
def _add_ranges(part, bias, out, M, N, stride_om, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out = ((part[0] + part[1]) + ...) + bias, the ranges in order, cast to out's dtype."""
    rm = (tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = (rm < M)[:, None] & (rn < N)[None, :]
    off = rm[:, None] * N + rn[None, :]
    plane = M.to(tl.int64) * N
    acc = tl.load(part + off, mask=m, other=0.)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(part + s * plane + off, mask=m, other=0.)
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=rn < N, other=0.).to(tl.float32)[None, :]
    tl.store(out + rm[:, None] * stride_om + rn[None, :], acc.to(out.dtype.element_ty), mask=m)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise ValueError("batch_invariant_linear: x and weight must be tensors")
    if weight.dim() != 2:
        raise ValueError(f"weight: expected [N, K], got shape {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x: last dim {x.shape[-1] if x.dim() else None} != weight's K {weight.shape[1]}")
    if x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x / weight: need one of bf16, fp16, fp32 for both, got {x.dtype} / {weight.dtype}")
    if x.device != weight.device:
        raise ValueError(f"x / weight: on {x.device} / {weight.device}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.device != x.device):
        raise ValueError(f"bias: expected [{weight.shape[0]}] on {x.device}, got {tuple(bias.shape)} on "
                         f"{bias.device}")


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                           config: MatmulConfig | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) -> [..., N] in x's dtype, fp32 accumulation; each row's bits
    independent of the other rows (inference: no autograd)."""
    _check(x, weight, bias)
    N, K = weight.shape
    rows = x.reshape(-1, K)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    M = rows.shape[0]
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    if M and N:
        if K == 0:
            out.zero_()
            if bias is not None:
                out += bias.to(out.dtype)
        else:
            cfg = config or config_for(x.device, x.dtype, N, K)
            precision = "ieee" if x.dtype == torch.float32 else "tf32"
            steps = cdiv(K, cfg.block_k)
            split = min(cfg.split_k, steps)   # (a range per program at most: none empty)
            if split <= 1:
                _matmul[(cdiv(N, cfg.block_n), cdiv(M, cfg.block_m))](
                    rows, weight, bias if bias is not None else weight, out, M, N, K, rows.stride(0),
                    weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m,
                    BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PRECISION=precision, num_warps=cfg.num_warps,
                    num_stages=cfg.num_stages)
            else:
                k_range = cdiv(steps, split) * cfg.block_k
                split = cdiv(K, k_range)
                part = torch.empty(split, M, N, device=x.device, dtype=torch.float32)
                _matmul_split[(cdiv(N, cfg.block_n), cdiv(M, cfg.block_m), split)](
                    rows, weight, part, M, N, K, k_range, rows.stride(0), weight.stride(0), BLOCK_M=cfg.block_m,
                    BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PRECISION=precision, num_warps=cfg.num_warps,
                    num_stages=cfg.num_stages)
                _add_ranges[(cdiv(N, 128), cdiv(M, 16))](
                    part, bias if bias is not None else weight, out, M, N, out.stride(0), SPLIT=split,
                    HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_N=128)
    return out.view(*x.shape[:-1], N)
