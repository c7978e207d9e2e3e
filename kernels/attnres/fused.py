"""Fused block Attention Residuals (Triton): forward, backward and the decode path.

Design (see k3-architecture.md §4; the math follows fla-core's `fla/ops/attnres` derivation, re-derived here):

* Sources are read where they live: up to 16 same-dtype tensors, each addressed by its offset from one base
  pointer and its own row stride, so one tile load covers several sources
  (a `[T, NB, D]` bank's `unbind(1)` views work as they are); nothing is stacked or copied.
* Forward: one program walks tokens (persistent grid); per token one pass over the sources with an online
  softmax over depth, so every source byte is read once. Per-token stats (key rstd, raw logit, lse: fp32,
  ~L*8 B/token) are saved; the mixture is recomputed in backward, never stored.
* Backward: per token, pass A recomputes the gradient of the pre-norm mixture (with the fused output norm:
  the mixture itself, with the forward's tiles and saved logits, so its bits match the forward) and
  dbar = sum_l p_l <v_l, dm>; pass B re-reads each source (the token's rows are still in L2), one row per step,
  and writes its gradient *into its final destination*:
    - a row registered with `attnres_grad_sink` (the model's bank rows): one buffer per row for the whole
      backward, accumulated in place by every AttnRes consumer and handed to autograd once;
    - a leaf (or a view of a leaf, e.g. a `[N, NB, D]` bank) whose `.grad` already exists: accumulated into
      that `.grad` in place (only when this backward is going to accumulate into it anyway, and there are no
      hooks on the leaf);
    - otherwise a fresh buffer returned to autograd, as usual.
  dquery / dweight / doutput-weight: per-program fp32 partials, reduced over programs in a fixed order (no
  atomics), so gradients are bitwise reproducible run to run.
* The per-token arithmetic depends only on the token (block sizes and warps depend on D only), so a row's
  output is independent of the batch it sits in; the decode path is the same kernel without saved stats.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from k3_kernels.launch import next_pow2, num_programs
from k3_kernels.reduce import colsum

MAX_SOURCES = 16


@triton.jit
def _pick(i: tl.constexpr, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15):
    """Compile-time selection of the i-th of 16 arguments (sources are separate pointers, not a stacked tensor)."""
    if i == 0:
        r = a0
    elif i == 1:
        r = a1
    elif i == 2:
        r = a2
    elif i == 3:
        r = a3
    elif i == 4:
        r = a4
    elif i == 5:
        r = a5
    elif i == 6:
        r = a6
    elif i == 7:
        r = a7
    elif i == 8:
        r = a8
    elif i == 9:
        r = a9
    elif i == 10:
        r = a10
    elif i == 11:
        r = a11
    elif i == 12:
        r = a12
    elif i == 13:
        r = a13
    elif i == 14:
        r = a14
    else:
        r = a15
    return r


@triton.jit
def _tile_offsets(t: tl.constexpr, TL: tl.constexpr, L: tl.constexpr, n,
                  X0, X1, X2, X3, X4, X5, X6, X7, X8, X9, X10, X11, X12, X13, X14, X15,
                  Y0, Y1, Y2, Y3, Y4, Y5, Y6, Y7, Y8, Y9, Y10, Y11, Y12, Y13, Y14, Y15):
    """Element offsets (from the base pointer) of token n's row in sources t*TL .. t*TL+TL-1: X_j + n * Y_j,
    X_j = source j's offset from the base allocation, Y_j its row stride (0 for lanes past L)."""
    lidx = tl.arange(0, TL)
    off = tl.zeros([TL], dtype=tl.int64)
    for j in tl.static_range(TL):
        if t * TL + j < L:
            o = _pick(t * TL + j, X0, X1, X2, X3, X4, X5, X6, X7, X8, X9, X10, X11, X12, X13, X14, X15) + \
                n * _pick(t * TL + j, Y0, Y1, Y2, Y3, Y4, Y5, Y6, Y7, Y8, Y9, Y10, Y11, Y12, Y13, Y14, Y15)
            off = tl.where(lidx == j, o, off)
    return off


@triton.jit
def _attnres_fwd_kernel(
    src_ptr, X0, X1, X2, X3, X4, X5, X6, X7, X8, X9, X10, X11, X12, X13, X14, X15,
    Y0, Y1, Y2, Y3, Y4, Y5, Y6, Y7, Y8, Y9, Y10, Y11, Y12, Y13, Y14, Y15,
    q_ptr, w_ptr, ow_ptr, o_ptr, rstd_ptr, logit_ptr, lse_ptr,
    N, D, eps, scale,
    L: tl.constexpr, TL: tl.constexpr, BLOCK_D: tl.constexpr, OUT_NORM: tl.constexpr, ROUND_MIX: tl.constexpr,
    STORE_STATS: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    lidx = tl.arange(0, TL)
    a = tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32) * tl.load(w_ptr + offs, mask=mask,
                                                                              other=0.0).to(tl.float32)
    if OUT_NORM:
        ow = tl.load(ow_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for tok in range(pid, N, nprog):
        n = tok + tl.zeros([], dtype=tl.int64)  # 64-bit offsets (N * row stride can exceed 2^31)
        m_run = -float("inf")
        l_run = 0.0
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        # online softmax over depth, TL sources per step (one wide load keeps many bytes in flight)
        for t in tl.static_range((L + TL - 1) // TL):
            jj = t * TL + lidx
            jm = jj < L
            off = _tile_offsets(t, TL, L, n, X0, X1, X2, X3, X4, X5, X6, X7, X8, X9, X10, X11, X12, X13, X14, X15,
                                Y0, Y1, Y2, Y3, Y4, Y5, Y6, Y7, Y8, Y9, Y10, Y11, Y12, Y13, Y14, Y15)
            v = tl.load(src_ptr + off[:, None] + offs[None, :], mask=jm[:, None] & mask[None, :],
                        other=0.0).to(tl.float32)
            r = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / D + eps)
            logit = r * tl.sum(v * a[None, :], axis=1)
            s = tl.where(jm, logit * scale, -float("inf"))
            m_new = tl.maximum(m_run, tl.max(s, axis=0))
            alpha = tl.exp(m_run - m_new)
            e = tl.exp(s - m_new)
            acc = acc * alpha + tl.sum(e[:, None] * v, axis=0)
            l_run = l_run * alpha + tl.sum(e, axis=0)
            m_run = m_new
            if STORE_STATS:
                tl.store(rstd_ptr + n * L + jj, r, mask=jm)
                tl.store(logit_ptr + n * L + jj, logit, mask=jm)
        mix = acc / l_run
        if STORE_STATS:
            tl.store(lse_ptr + n, m_run + tl.log(l_run))
        if OUT_NORM:
            if ROUND_MIX:
                mix = mix.to(o_ptr.dtype.element_ty).to(tl.float32)
            rs = 1.0 / tl.sqrt(tl.sum(mix * mix, axis=0) / D + eps)
            mix = mix * rs * ow
        tl.store(o_ptr + n * D + offs, mix.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_src(i: tl.constexpr, n, offs, mask,
              S0, S1, S2, S3, S4, S5, S6, S7, S8, S9, S10, S11, S12, S13, S14, S15,
              R0, R1, R2, R3, R4, R5, R6, R7, R8, R9, R10, R11, R12, R13, R14, R15):
    ptr = _pick(i, S0, S1, S2, S3, S4, S5, S6, S7, S8, S9, S10, S11, S12, S13, S14, S15)
    stride = _pick(i, R0, R1, R2, R3, R4, R5, R6, R7, R8, R9, R10, R11, R12, R13, R14, R15)
    return tl.load(ptr + n * stride + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _attnres_bwd_kernel(
    src_ptr, X0, X1, X2, X3, X4, X5, X6, X7, X8, X9, X10, X11, X12, X13, X14, X15,
    Y0, Y1, Y2, Y3, Y4, Y5, Y6, Y7, Y8, Y9, Y10, Y11, Y12, Y13, Y14, Y15,
    S0, S1, S2, S3, S4, S5, S6, S7, S8, S9, S10, S11, S12, S13, S14, S15,
    R0, R1, R2, R3, R4, R5, R6, R7, R8, R9, R10, R11, R12, R13, R14, R15,
    G0, G1, G2, G3, G4, G5, G6, G7, G8, G9, G10, G11, G12, G13, G14, G15,
    Q0, Q1, Q2, Q3, Q4, Q5, Q6, Q7, Q8, Q9, Q10, Q11, Q12, Q13, Q14, Q15,
    q_ptr, w_ptr, ow_ptr, do_ptr, rstd_ptr, logit_ptr, lse_ptr, da_part_ptr, dow_part_ptr,
    N, D, eps, scale, write_mask, acc_mask,
    L: tl.constexpr, TLF: tl.constexpr, BLOCK_D: tl.constexpr, OUT_NORM: tl.constexpr, ROUND_MIX: tl.constexpr,
):
    """One source per step (a 1-D row at a time measured faster here than multi-source tiles); the mixture for
    the fused output norm is recomputed with the forward's own tiles and saved logits, so its bits match."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    a = tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32) * tl.load(w_ptr + offs, mask=mask,
                                                                              other=0.0).to(tl.float32)
    da_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    if OUT_NORM:
        ow = tl.load(ow_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dow_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for tok in range(pid, N, nprog):
        n = tok + tl.zeros([], dtype=tl.int64)  # 64-bit offsets
        do = tl.load(do_ptr + n * D + offs, mask=mask, other=0.0).to(tl.float32)
        lse = tl.load(lse_ptr + n)
        # pass A: gradient of the pre-norm mixture (dm) and dbar = sum_l p_l <v_l, dm>
        if OUT_NORM:
            lidf = tl.arange(0, TLF)
            m_run = -float("inf")
            l_run = 0.0
            acc = tl.zeros([BLOCK_D], dtype=tl.float32)
            for t in tl.static_range((L + TLF - 1) // TLF):
                jj = t * TLF + lidf
                jm = jj < L
                off = _tile_offsets(t, TLF, L, n, X0, X1, X2, X3, X4, X5, X6, X7, X8, X9, X10, X11, X12, X13, X14, X15,
                                    Y0, Y1, Y2, Y3, Y4, Y5, Y6, Y7, Y8, Y9, Y10, Y11, Y12, Y13, Y14, Y15)
                v = tl.load(src_ptr + off[:, None] + offs[None, :], mask=jm[:, None] & mask[None, :],
                            other=0.0).to(tl.float32)
                s = tl.where(jm, tl.load(logit_ptr + n * L + jj, mask=jm, other=0.0) * scale, -float("inf"))
                m_new = tl.maximum(m_run, tl.max(s, axis=0))
                alpha = tl.exp(m_run - m_new)
                e = tl.exp(s - m_new)
                acc = acc * alpha + tl.sum(e[:, None] * v, axis=0)
                l_run = l_run * alpha + tl.sum(e, axis=0)
                m_run = m_new
            mix = acc / l_run
            mm = mix
            if ROUND_MIX:
                mm = mix.to(do_ptr.dtype.element_ty).to(tl.float32)
            rs = 1.0 / tl.sqrt(tl.sum(mm * mm, axis=0) / D + eps)
            y = mm * rs
            dow_acc += do * y
            g = do * ow
            dm = rs * (g - y * (tl.sum(g * y, axis=0) / D))
            dbar = tl.sum(mix * dm, axis=0)
        else:
            dm = do
            dbar = 0.0
            for i in tl.static_range(L):
                v = _load_src(i, n, offs, mask, S0, S1, S2, S3, S4, S5, S6, S7, S8, S9, S10, S11, S12, S13, S14, S15,
                              R0, R1, R2, R3, R4, R5, R6, R7, R8, R9, R10, R11, R12, R13, R14, R15)
                p = tl.exp(tl.load(logit_ptr + n * L + i) * scale - lse)
                dbar += p * tl.sum(v * dm, axis=0)
        # pass B: per-source gradients, written / accumulated into their destinations
        for i in tl.static_range(L):
            v = _load_src(i, n, offs, mask, S0, S1, S2, S3, S4, S5, S6, S7, S8, S9, S10, S11, S12, S13, S14, S15,
                          R0, R1, R2, R3, R4, R5, R6, R7, R8, R9, R10, R11, R12, R13, R14, R15)
            logit = tl.load(logit_ptr + n * L + i)
            r = tl.load(rstd_ptr + n * L + i)
            p = tl.exp(logit * scale - lse)
            gs = scale * p * (tl.sum(v * dm, axis=0) - dbar) * r
            da_acc += gs * v
            if ((write_mask | acc_mask) >> i) & 1:
                dv = p * dm + gs * (a - (r * logit / D) * v)
                gptr = _pick(i, G0, G1, G2, G3, G4, G5, G6, G7, G8, G9, G10, G11, G12, G13, G14, G15)
                gptr = gptr + n * _pick(i, Q0, Q1, Q2, Q3, Q4, Q5, Q6, Q7, Q8, Q9, Q10, Q11, Q12, Q13, Q14, Q15) + offs
                if (acc_mask >> i) & 1:
                    dv += tl.load(gptr, mask=mask, other=0.0).to(tl.float32)
                tl.store(gptr, dv.to(gptr.dtype.element_ty), mask=mask)
    tl.store(da_part_ptr + pid * D + offs, da_acc, mask=mask)
    if OUT_NORM:
        tl.store(dow_part_ptr + pid * D + offs, dow_acc, mask=mask)


# ----------------------------------------------------------------------------------------------------------------
# launch configuration: depends on D only (batch invariance), never on the number of tokens


class _Cfg(NamedTuple):
    block_d: int
    warps_fwd: int
    warps_bwd: int
    per_sm_fwd: int   # resident programs per SM (persistent grid)
    per_sm_bwd: int
    tl_fwd: int       # sources per forward load step


@functools.lru_cache(maxsize=None)
def _config(D: int) -> _Cfg:
    """Launch configuration: a function of D alone (never of the token count), so results are batch invariant.
    D = 7168 values from the H200 sweep in benchmarks/results/attnres.json."""
    block = next_pow2(D)
    if block >= 8192:
        return _Cfg(block, 16, 8, 1, 2, 4)
    if block >= 2048:
        return _Cfg(block, 8, 8, 2, 2, 4)
    return _Cfg(block, 4, 4, 4, 2, 4)


# ----------------------------------------------------------------------------------------------------------------
# gradient destinations


class AttnResGradSink:
    """Gradient buffer of one stored block row, shared by every AttnRes consumer of that row in a backward pass."""

    __slots__ = ("grad",)

    def __init__(self) -> None:
        self.grad: torch.Tensor | None = None


class _SinkFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, sink: AttnResGradSink) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        ctx.sink = sink
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor | None):
        total, ctx.sink.grad = ctx.sink.grad, None
        if g is not None:
            total = g if total is None else total.add_(g)
        return total, None


def attnres_grad_sink(x: torch.Tensor) -> torch.Tensor:
    """Alias of a block row whose AttnRes gradients accumulate in one buffer (no buffer per consumer).

    Store the returned tensor in the bank; its gradient reaches `x` once, after every consumer has run.
    Identity (returns `x`) when `x` needs no gradient.
    """
    if not (x.requires_grad and torch.is_grad_enabled()):
        return x
    sink = AttnResGradSink()
    y = _SinkFn.apply(x, sink)
    y._k3_attnres_sink = sink
    return y


def _leaf_grad_view(src: torch.Tensor) -> torch.Tensor | None:
    """The part of an existing leaf `.grad` that `src` (the leaf or a view of it) maps to, when this backward will
    accumulate into that leaf anyway; else None."""
    base = src if src._base is None else src._base
    if not (base.is_leaf and base.requires_grad) or base.grad is None:
        return None
    if base._backward_hooks or getattr(base, "_post_accumulate_grad_hooks", None):
        return None
    grad = base.grad
    if grad.dtype != base.dtype or grad.stride() != base.stride() or grad.shape != base.shape:
        return None
    try:
        node = torch.autograd.graph.get_gradient_edge(base).node
        if not torch._C._will_engine_execute_node(node):
            return None
    except RuntimeError:  # autograd.grad(): results are returned, not accumulated into .grad
        return None
    if src is base:
        return grad
    return grad.as_strided(src.shape, src.stride(), grad.storage_offset() + src.storage_offset() - base.storage_offset())


def _flat(x: torch.Tensor, D: int, name: str) -> torch.Tensor:
    if x.shape[-1] != D or x.stride(-1) != 1:
        raise ValueError(f"{name}: expected last dim {D} with unit stride, got shape {tuple(x.shape)} "
                         f"stride {tuple(x.stride())}")
    try:
        return x.view(-1, D)
    except RuntimeError as e:
        raise ValueError(f"{name}: leading dims of shape {tuple(x.shape)} stride {tuple(x.stride())} cannot be "
                         f"flattened without a copy") from e


def _ptr_args(xs: Sequence[torch.Tensor]) -> list:
    """Per source its own pointer, then its row stride (padded to 16)."""
    pad = MAX_SOURCES - len(xs)
    return [*xs, *([xs[0]] * pad), *(x.stride(0) for x in xs), *([0] * pad)]


def _offset_args(xs: Sequence[torch.Tensor]) -> list:
    """Base tensor, then per source its element offset from the base and its row stride (padded to 16).

    Sources are addressed from one base pointer so a kernel can load several of them in one tile."""
    base = xs[0]
    size = base.element_size()
    offs = []
    for i, x in enumerate(xs):
        delta = x.data_ptr() - base.data_ptr()
        if x.dtype != base.dtype or delta % size:
            raise ValueError(f"sources[{i}]: dtype {x.dtype} / alignment differs from sources[0] ({base.dtype})")
        offs.append(delta // size)
    pad = MAX_SOURCES - len(xs)
    return [base, *offs, *([0] * pad), *(x.stride(0) for x in xs), *([0] * pad)]


# ----------------------------------------------------------------------------------------------------------------
# autograd


def _forward(flat: list[torch.Tensor], query: torch.Tensor, weight: torch.Tensor, ow: torch.Tensor | None,
             out_dtype: torch.dtype, eps: float, scale: float, round_mix: bool, store_stats: bool):
    N, D = flat[0].shape
    L = len(flat)
    dev = flat[0].device
    o = torch.empty(N, D, device=dev, dtype=out_dtype)
    if store_stats:
        rstd = torch.empty(N, L, device=dev, dtype=torch.float32)
        logit = torch.empty(N, L, device=dev, dtype=torch.float32)
        lse = torch.empty(N, device=dev, dtype=torch.float32)
    else:
        rstd = logit = lse = o
    if N == 0:
        return o, rstd, logit, lse
    cfg = _config(D)
    grid = (num_programs(N, dev, cfg.per_sm_fwd),)
    _attnres_fwd_kernel[grid](*_offset_args(flat), query, weight, ow if ow is not None else weight, o, rstd, logit,
                              lse, N, D, eps, scale, L=L, TL=cfg.tl_fwd, BLOCK_D=cfg.block_d, OUT_NORM=ow is not None,
                              ROUND_MIX=round_mix, STORE_STATS=store_stats, num_warps=cfg.warps_fwd)
    return o, rstd, logit, lse


class _AttnResFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, weight, ow, meta, *sources):
        eps, scale, round_mix, out_dtype = meta
        D = sources[0].shape[-1]
        flat = [_flat(s, D, f"sources[{i}]") for i, s in enumerate(sources)]
        o, rstd, logit, lse = _forward(flat, query, weight, ow, out_dtype, eps, scale, round_mix, True)
        ctx.save_for_backward(query, weight, ow, rstd, logit, lse, *sources)
        ctx.meta = meta
        ctx.mark_non_differentiable(logit, lse)
        return o.view(sources[-1].shape[:-1] + (D,)), logit, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, _dlogit, _dlse):
        query, weight, ow, rstd, logit, lse, *sources = ctx.saved_tensors
        eps, scale, round_mix, _ = ctx.meta
        L = len(sources)
        D = sources[0].shape[-1]
        flat = [_flat(s, D, f"sources[{i}]") for i, s in enumerate(sources)]
        N = flat[0].shape[0]
        dev = flat[0].device
        do = do.reshape(N, D).contiguous()
        needs = ctx.needs_input_grad[4:]
        grads: list[torch.Tensor | None] = [None] * L      # returned to autograd
        dests: list[torch.Tensor] = []                     # where the kernel writes (lanes in neither mask: unused)
        later: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer already targeted, separate partial)
        write_mask = acc_mask = 0
        seen: set[tuple[int, tuple]] = set()
        for i, s in enumerate(sources):
            if not needs[i]:
                dests.append(None)
                continue
            sink = getattr(s, "_k3_attnres_sink", None)
            if sink is not None:
                fresh = sink.grad is None   # fresh: the kernel writes the gradient; else adds to what is there
                if fresh:
                    sink.grad = torch.empty(s.shape, device=dev, dtype=s.dtype)
                dest = sink.grad
            else:
                dest = _leaf_grad_view(s)
                fresh = dest is None
                if fresh:
                    dest = grads[i] = torch.empty(s.shape, device=dev, dtype=s.dtype)
            key = (dest.data_ptr(), tuple(dest.stride()))
            if key in seen:  # the same buffer twice (a source passed twice): own buffer, added after the kernel
                tmp = torch.empty(s.shape, device=dev, dtype=s.dtype)
                later.append((dest, tmp))
                dest, fresh = tmp, True
            seen.add(key)
            if fresh:
                write_mask |= 1 << i
            else:
                acc_mask |= 1 << i
            dests.append(_flat(dest, D, f"grad of sources[{i}]"))
        dests = [flat[i] if d is None else d for i, d in enumerate(dests)]  # (no gradient asked: never written)
        cfg = _config(D)
        P = num_programs(N, dev, cfg.per_sm_bwd)
        da_part = torch.empty(P, D, device=dev, dtype=torch.float32)
        dow_part = torch.empty(P, D, device=dev, dtype=torch.float32) if ow is not None else da_part
        if N > 0:
            _attnres_bwd_kernel[(P,)](*_offset_args(flat), *_ptr_args(flat), *_ptr_args(dests), query, weight,
                                      ow if ow is not None else weight, do, rstd, logit, lse, da_part, dow_part,
                                      N, D, eps, scale, write_mask, acc_mask, L=L, TLF=cfg.tl_fwd,
                                      BLOCK_D=cfg.block_d, OUT_NORM=ow is not None, ROUND_MIX=round_mix,
                                      num_warps=cfg.warps_bwd)
        else:
            da_part.zero_()
            dow_part.zero_()
        for dest, tmp in later:
            dest.add_(tmp)
        da = colsum(da_part)
        dq = (da * weight.float()).to(query.dtype) if ctx.needs_input_grad[0] else None
        dw = (da * query.float()).to(weight.dtype) if ctx.needs_input_grad[1] else None
        dow = colsum(dow_part, ow.dtype) if ow is not None and ctx.needs_input_grad[2] else None
        return (dq, dw, dow, None, *grads)


def _check(sources: Sequence[torch.Tensor], query: torch.Tensor, weight: torch.Tensor,
           ow: torch.Tensor | None) -> int:
    if not 1 <= len(sources) <= MAX_SOURCES:
        raise ValueError(f"sources: expected 1..{MAX_SOURCES} tensors (rows + partial), got {len(sources)}")
    D = sources[-1].shape[-1]
    lead = sources[-1].shape[:-1]
    for i, s in enumerate(sources):
        if s.shape[:-1] != lead or s.shape[-1] != D:
            raise ValueError(f"sources[{i}]: shape {tuple(s.shape)} does not match {tuple(lead) + (D,)}")
        if s.device != sources[-1].device:
            raise ValueError(f"sources[{i}]: on {s.device}, expected {sources[-1].device}")
    for name, t in (("query", query), ("norm_weight", weight), ("output_norm_weight", ow)):
        if t is not None and (t.numel() != D or t.device != sources[-1].device):
            raise ValueError(f"{name}: expected {D} elements on {sources[-1].device}, got shape {tuple(t.shape)} "
                             f"on {t.device}")
    return D


def _apply(sources: list[torch.Tensor], query: torch.Tensor, weight: torch.Tensor, ow: torch.Tensor | None,
           eps: float, scale: float, round_mix: bool, out_dtype: torch.dtype, want_stats: bool):
    """Returns (o, logit [N, L], lse [N]); without autograd the stats are only computed when `want_stats`."""
    D = _check(sources, query, weight, ow)
    query = query.reshape(D).contiguous()
    weight = weight.reshape(D).contiguous()
    ow = ow.reshape(D).contiguous() if ow is not None else None
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (*sources, query, weight, ow))
    if grad:
        o, logit, lse = _AttnResFn.apply(query, weight, ow, (float(eps), float(scale), round_mix, out_dtype),
                                         *sources)
        return o, logit, lse
    flat = [_flat(s, D, f"sources[{i}]") for i, s in enumerate(sources)]
    o, _, logit, lse = _forward(flat, query, weight, ow, out_dtype, eps, scale, round_mix, want_stats)
    return o.view(sources[-1].shape), logit, lse


def fused_block_attnres(rows: Sequence[torch.Tensor], partial: torch.Tensor, query: torch.Tensor,
                        norm_weight: torch.Tensor, eps: float = 1e-6,
                        output_norm_weight: torch.Tensor | None = None) -> torch.Tensor:
    """K3 block AttnRes (same contract as `naive_block_attnres`): rows (embedding first) + partial, each [..., D].

    The mixture is rounded to `partial.dtype`; with `output_norm_weight` the following RMSNorm is fused and
    applied to that rounded mixture, as K3 does.
    """
    sources = [*rows, partial]
    o, _, _ = _apply(sources, query, norm_weight, output_norm_weight, eps, 1.0, True, partial.dtype, False)
    return o


@torch.no_grad()
def block_attnres_decode(rows: Sequence[torch.Tensor], partial: torch.Tensor, query: torch.Tensor,
                         norm_weight: torch.Tensor, eps: float = 1e-6,
                         output_norm_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Decode path (one token per sequence, rows [B, D]): forward only, no saved stats; bitwise equal to the
    corresponding rows of `fused_block_attnres` on a whole prefill."""
    sources = [*rows, partial]
    D = _check(sources, query, norm_weight, output_norm_weight)
    flat = [_flat(s, D, f"sources[{i}]") for i, s in enumerate(sources)]
    ow = output_norm_weight.reshape(D).contiguous() if output_norm_weight is not None else None
    o, *_ = _forward(flat, query.reshape(D).contiguous(), norm_weight.reshape(D).contiguous(), ow, partial.dtype,
                     eps, 1.0, True, False)
    return o.view(partial.shape)


def fused_attnres(query: torch.Tensor, residuals: Sequence[torch.Tensor], rms_weight: torch.Tensor,
                  output_rms_weight: torch.Tensor | None = None, rms_eps: float = 1e-6, scale: float = 1.0,
                  return_weights: bool = False, checkpoint_level: int = 1):
    """fla-core `fused_attnres` signature and semantics (full AttnRes; the fused output norm is applied to the fp32
    mixture, rounded once). The mixture is always recomputed in backward, so `checkpoint_level` (0 or 1) only
    is validated. Weights, when returned, are `[L, ...]` fp32 and not differentiable."""
    if checkpoint_level not in (0, 1):
        raise ValueError(f"checkpoint_level must be 0 or 1, got {checkpoint_level}")
    if len(residuals) == 0:
        raise ValueError("residuals must contain at least one source")
    sources = list(residuals)
    o, logit, lse = _apply(sources, query, rms_weight, output_rms_weight, rms_eps, scale, False, sources[0].dtype,
                           return_weights)
    if not return_weights:
        return o
    p = torch.exp(logit.detach() * scale - lse.detach()[:, None]).t()
    return o, p.reshape(len(sources), *sources[0].shape[:-1])
