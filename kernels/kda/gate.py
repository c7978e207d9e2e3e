"""The backward of the gate that `chunk_kda(use_gate_in_kernel=True)` applies in its cumsum kernel, as one Triton
pass: from the raw gate input g and dG (the gradient of the log-decay, from the backward intra kernel) it writes dg
and per-block partial sums of ddt_bias and dA_log, which a fixed-order sum over blocks finishes (no atomics:
bitwise reproducible). It also holds the gate's forward (`gate_activation`), which every kernel that applies the
gate inlines (`_fwd_cumsum`, `_recurrent_fwd`, the step-inputs kernel). Gates (`naive.py` is the spec):
  GATE_DEFAULT, KDA's:    y = -exp(A_log) softplus(x),            x = g + dt_bias
  GATE_SAFE, K3's:        y = lower_bound sigmoid(exp(A_log) x)   (without A_log: lower_bound sigmoid(x))
dg = dy * dy/dx, ddt_bias = sum over tokens of dg, dA_log = sum of dy * y (default) or of dg * x (safe)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3_kernels.launch import cdiv

from .plan import pow2_tile

# the gate a kernel applies to g (a constexpr of every kernel that takes one)
GATE_NONE = tl.constexpr(0)      # g is the log-decay already
GATE_DEFAULT = tl.constexpr(1)   # KDA's: -exp(A_log) softplus(g + dt_bias)
GATE_SAFE = tl.constexpr(2)      # K3's: lower_bound sigmoid(exp(A_log) (g + dt_bias))


def gate_mode(use_gate_in_kernel: bool, lower_bound: float | None) -> int:
    """The GATE constexpr for a call: none, KDA's default gate, or K3's safe gate (`lower_bound` set)."""
    if not use_gate_in_kernel:
        return GATE_NONE.value
    return GATE_SAFE.value if lower_bound is not None else GATE_DEFAULT.value


@triton.jit
def gate_activation(x, a_exp, lower_bound, GATE: tl.constexpr, HAS_A: tl.constexpr):
    """The log-decay from x = g + dt_bias (fp32); a_exp = exp(A_log) (read by the safe gate only with HAS_A).
    Softplus is linear above 20, as torch's."""
    y = x
    if GATE == GATE_DEFAULT:
        y = -a_exp * tl.where(x > 20., x, tl.log(1. + tl.exp(tl.minimum(x, 20.))))
    elif GATE == GATE_SAFE:
        if HAS_A:
            y = x * a_exp
        y = lower_bound * tl.sigmoid(y)
    return y


ROWS = 64  # tokens per step of a program
STEPS = 4  # steps per program (so a program covers 256 tokens)


@triton.jit
def _gate_bwd(g, dG, A_log, dt_bias, dg, part_dt, part_A, n_tok, lower_bound, HV, K, BK: tl.constexpr,
              ROWS: tl.constexpr, STEPS: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr,
              HAS_DT: tl.constexpr):
    blk = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1).to(tl.int64)
    ok = tl.arange(0, BK)
    km = ok < K
    bias = tl.zeros([BK], dtype=tl.float32)
    if HAS_DT:
        bias = tl.load(dt_bias + hv * K + ok, mask=km, other=0.).to(tl.float32)
    a = 1.
    if HAS_A:
        a = tl.exp(tl.load(A_log + hv).to(tl.float32))
    acc_dt = tl.zeros([BK], dtype=tl.float32)
    acc_A = tl.zeros([BK], dtype=tl.float32)
    for s in range(STEPS):
        tok = blk * (ROWS * STEPS) + s * ROWS + tl.arange(0, ROWS)
        m = (tok < n_tok)[:, None] & km[None, :]
        p = (tok * HV + hv)[:, None] * K + ok[None, :]
        x = tl.load(g + p, mask=m, other=0.).to(tl.float32) + bias[None, :]
        dy = tl.load(dG + p, mask=m, other=0.).to(tl.float32)
        if GATE == GATE_DEFAULT:
            sp = tl.where(x > 20., x, tl.log(1. + tl.exp(tl.minimum(x, 20.))))
            dx = -a * tl.sigmoid(x) * dy
            contrib_A = -a * sp * dy  # dy * y
        else:
            sg = tl.sigmoid(a * x)
            dx = lower_bound * sg * (1. - sg) * a * dy
            contrib_A = dx * x
        dx = tl.where(m, dx, 0.)
        tl.store(dg + p, dx.to(dg.dtype.element_ty), mask=m)
        acc_dt += tl.sum(dx, 0)
        acc_A += tl.sum(tl.where(m, contrib_A, 0.), 0)
    tl.store(part_dt + (blk * HV + hv) * K + ok, acc_dt, mask=km)
    if HAS_A:
        tl.store(part_A + blk * HV + hv, tl.sum(acc_A, 0))


def gate_backward(g: torch.Tensor, dG: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
                  gate: int, lower_bound: float | None) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                 torch.Tensor | None]:
    """(dg in g's dtype, dA_log like A_log or None, ddt_bias like dt_bias or None) for g [B, T, HV, K] contiguous
    and dG fp32 of its shape."""
    HV, K = g.shape[-2:]
    n_tok = g.numel() // (HV * K)
    blocks = max(cdiv(n_tok, ROWS * STEPS), 1)
    dg = torch.empty_like(g)
    part_dt = torch.empty(blocks, HV, K, device=g.device, dtype=torch.float32)
    part_A = torch.empty(blocks, HV, device=g.device, dtype=torch.float32) if A_log is not None else part_dt
    _gate_bwd[(blocks, HV)](g, dG, A_log if A_log is not None else part_dt, dt_bias if dt_bias is not None else part_dt,
                            dg, part_dt, part_A, n_tok, float(lower_bound) if lower_bound is not None else 0., HV, K,
                            BK=pow2_tile(K), ROWS=ROWS, STEPS=STEPS, GATE=gate, HAS_A=A_log is not None,
                            HAS_DT=dt_bias is not None, num_warps=4)
    dA = part_A.sum(0).view(A_log.shape).to(A_log.dtype) if A_log is not None else None
    ddt = part_dt.sum(0).view(dt_bias.shape).to(dt_bias.dtype) if dt_bias is not None else None
    return dg, dA, ddt
