"""Chunked KDA in Triton: forward and backward (autograd), FLA-compatible `chunk_kda`.

Math (per head, chunk C = 64, G = in-chunk cumulative log-decay, q~ = scale * q), as in `naive_chunk_kda`:
  A[i,j]   = beta_i <k_i e^{G_i-G_j}, k_j>  (i > j),   M = (I + A)^-1
  W = M (beta k e^G),  U = M (beta v),  Aqk[i,j] = <q~_i e^{G_i-G_j}, k_j> (j <= i)
  v' = U - W S,  o = (q~ e^G) S + Aqk v',  S <- e^{G_C} S + (k e^{G_C-G})^T v'

Kernels (layout and staging ideas from fla-core 0.6.0 `fla/ops/kda/chunk_intra.py`, `fla/ops/common/chunk_delta_h.py`,
`fla/ops/kda/chunk_bwd.py`; written independently, no code copied). Forward:
  `_fwd_cumsum` (chunk, head, K slice): fused gate activation + in-chunk cumsum G.
  `_fwd_intra` (chunk, head), two launches: A and Aqk with 64-row tensor-core dots, summed over K slices; a chunk
     whose channels each span at most 80 of log-decay as one pair of dots per slice around each channel's midpoint
     (the launch with WHOLE set), any other chunk as 16-row blocks (the other launch): off-diagonal blocks per
     column block J around G at J's last row, so both exponential factors are <= 1, diagonal blocks around their
     middle rows when every |G - G_mid| <= 40 (always for K3's gate), else exactly; then M = (I + A)^-1 in a
     product form of ten 64 x 64 x 64 dots, W, U, q e^G, k e^{G_C-G}; on CUDA each exponential is one
     `ex2.approx.ftz` (`_exp2`). (FLA splits this into three kernels of 16-row tiles.)
  `_fwd_state` (sequence, head, V block): the serial pass over chunks. The columns of the state evolve
     independently (v' = U - W S is column-wise), so splitting V gives B*HV*V/BV programs instead of B*HV;
     the output is fused into the pass, so in inference the per-chunk states never reach memory. A packed batch
     whose sequences fall into classes by length (`_state_classes`, longest first) is done class by class:
     cumsum and intra of a class, then its state pass on a high-priority side stream of its own (`_forked`) while
     the later classes' work runs on the current stream (the last class's pass too); a forked pass takes wide V
     blocks (few programs: most multiprocessors stay with the later classes' intra work; CONFIG
     `fwd_state_forked_*`).
Backward: `_bwd_state` (reverse pass for dS and dv', same V split; a packed batch's classes at once, each but the
last on a side stream), `_bwd_prep` (chunk, head: dv, dbeta, dAqk,
dA = -M^T dM M^T and the direct parts of dq, dk, dG), `_bwd_intra` (chunk, head: the gradients through the
gated products, K slice by K slice, and the reverse in-chunk cumsum for dg; writes dq, dk, dg): a chunk whose
log-decay spans at most 80 per channel as 64-row dots around each channel's midpoint (`_bwd_whole`), any other as
16 x 16 blocks (`_bwd_blocks`; a 64-row version with per-block factors like the forward's measured slower:
kernels/kda/NOTES.md).
Every reduction has a fixed order and there are no atomics: results are bitwise reproducible.
Intermediates live in a chunk-padded layout [chunks, HV, 64, D] so that later kernels need no row masks.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from k3_kernels.launch import cdiv, next_pow2, num_sms

from .naive import l2norm, naive_kda_gate, naive_kda_lowerbound_gate

BT = 64  # chunk size

# launch settings (no autotuning, so the interpreter and the GPU run the same configs)
CONFIG = {"fwd_state_bv": None, "fwd_state_warps": 4, "fwd_state_stages": 3,  # bv None: by parallelism
          # a packed batch's classes (`_state_classes`, at most `state_classes`, read when a batch's plan is first
          # built): the passes of all but the last forked beside the later classes' work (`_fwd`), and the last's
          # (None: by parallelism, as above)
          "state_classes": 3, "fwd_state_forked_bv": 64, "fwd_state_forked_stages": 2, "fwd_state_rest_bv": None,
          "fwd_state_rest_stages": None,
          "bwd_state_bv": None, "bwd_state_warps": 4, "bwd_state_stages": 3,  # (`_state_split`)
          "intra_bk": 32, "intra_warps": 4, "intra_stages": 3, "intra_maxnreg": None,  # the 16-row-block launch
          "intra_whole_warps": 4, "intra_whole_stages": 3, "intra_whole_maxnreg": 168,  # its whole-chunk launch
          "bwd_intra_bk": 32, "bwd_intra_warps": 4, "bwd_intra_stages": 2,
          "bwd_prep_bv": 64, "bwd_prep_warps": 4, "bwd_prep_stages": 1, "ka": 32,
          "dot_precision": None,  # None: by input dtype and kernel (`_prec`); or force one of triton's everywhere
          "bwd_intra_precision": None, "bwd_prep_precision": None}  # per kernel, 16-bit inputs (None: TF32)


@triton.jit
def _chunk_rows(cu, cidx, c):
    """(sequence, first token, valid rows from that token) of global chunk c."""
    n = tl.load(cidx + 2 * c).to(tl.int64)
    t0 = tl.load(cu + n).to(tl.int64) + tl.load(cidx + 2 * c + 1).to(tl.int64) * 64
    return n, t0, tl.load(cu + n + 1).to(tl.int64) - t0


@triton.jit
def _fwd_cumsum(g, A_log, dt_bias, Gc, cu, cidx, c_first, lower_bound, HV, K, BK: tl.constexpr, KA: tl.constexpr,
                GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr):
    """Gate activation (optional) and in-chunk cumulative sum of one K slice, fp32, chunk layout; the launch covers
    the chunks from c_first on."""
    c = tl.program_id(0).to(tl.int64) + c_first
    hv = tl.program_id(1).to(tl.int64)
    oc = tl.program_id(2) * KA + tl.arange(0, KA)
    _, t0, nv = _chunk_rows(cu, cidx, c)
    r = tl.arange(0, 64)
    m = (r < nv)[:, None] & (oc < K)[None, :]
    gx = tl.load(g + ((t0 + r) * HV + hv)[:, None] * K + oc[None, :], mask=m, other=0.).to(tl.float32)
    if GATE == 1:  # -exp(A_log) * softplus(g + dt_bias)
        if HAS_DT:
            gx = gx + tl.load(dt_bias + hv * K + oc, mask=oc < K, other=0.).to(tl.float32)[None, :]
        sp = tl.where(gx > 20., gx, tl.log(1. + tl.exp(tl.minimum(gx, 20.))))
        gx = -tl.exp(tl.load(A_log + hv).to(tl.float32)) * sp
    elif GATE == 2:  # lower_bound * sigmoid(exp(A_log) * (g + dt_bias))
        if HAS_DT:
            gx = gx + tl.load(dt_bias + hv * K + oc, mask=oc < K, other=0.).to(tl.float32)[None, :]
        if HAS_A:
            gx = gx * tl.exp(tl.load(A_log + hv).to(tl.float32))
        gx = lower_bound * tl.sigmoid(gx)
    gx = tl.where(m, gx, 0.)
    tl.store(Gc + (c * HV + hv) * 64 * BK + r[:, None] * BK + oc[None, :], tl.cumsum(gx, 0))


@triton.jit
def _intra_program(q, k, Gc, cu, cidx, c_first, H, HV, K, BK: tl.constexpr):
    """This (chunk c_first + program, value head) program's value head, first token, valid rows, chunk-layout
    base, G tile pointer and its q/k heads."""
    c = tl.program_id(0).to(tl.int64) + c_first
    hv = tl.program_id(1).to(tl.int64)
    _, t0, nv = _chunk_rows(cu, cidx, c)
    base = c * HV + hv
    h = hv // (HV // H)
    return hv, t0, nv, base, Gc + base * 64 * BK, q + h * K, k + h * K


@triton.jit
def _tile(p, t0, rows, nv, stride, oc, K):
    """[len(rows), len(oc)] fp32 tile of token rows t0 + rows of a token-major tensor (row stride `stride`), zeros
    past nv rows / K columns."""
    return tl.load(p + (t0 + rows)[:, None] * stride + oc[None, :], mask=(rows < nv)[:, None] & (oc < K)[None, :],
                   other=0.).to(tl.float32)


@triton.jit
def _chunk_tile(p, t0, nv, stride, oc, K):
    """`_tile` of all 64 rows of the chunk."""
    return _tile(p, t0, tl.arange(0, 64), nv, stride, oc, K)


LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _exp2(x, FAST: tl.constexpr):
    """2^x. FAST (CUDA): one MUFU instruction, `ex2.approx.ftz` (results below 2^-126 flush to zero, harmless for
    decay factors), instead of the subnormal range fix-ups around `ex2.approx` that `tl.exp` / `tl.exp2` compile to
    (five instructions per element with the log2 e scaling; the forward intra kernel evaluates ~28 [64, 32] tiles
    of them per program). The interpreter takes `tl.exp2`."""
    if FAST:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return tl.exp2(x)


@triton.jit
def _gate_refs(pG, oc, BK: tl.constexpr):
    """G over one K slice and, per row, G at the last row (`end`) and the middle row (`mid`) of its 16-row block,
    in log2 units (times log2 e, for `_exp2`)."""
    r = tl.arange(0, 64)
    blk0 = r // 16 * 16
    G = tl.load(pG + r[:, None] * BK + oc[None, :])
    return (G * LOG2E, tl.load(pG + (blk0 + 15)[:, None] * BK + oc[None, :]) * LOG2E,
            tl.load(pG + (blk0 + 8)[:, None] * BK + oc[None, :]) * LOG2E)


@triton.jit
def _later_factor(pG, G2, oc, J: tl.constexpr, BK: tl.constexpr, FAST: tl.constexpr):
    """e^{G_i - G_end(J)} for rows i after 16-row block J, 0 elsewhere (G never rises, so the factor is <= 1); G2
    in log2 units."""
    r = tl.arange(0, 64)
    gJ = tl.load(pG + (16 * J + 15) * BK + oc) * LOG2E
    return _exp2(tl.where((r >= 16 * (J + 1))[:, None], G2 - gJ[None, :], float("-inf")), FAST)


@triton.jit
def _diag_gated(kt, qt, G2, Gmid2, pG, kh, t0, nv, stride, oc, K, BK: tl.constexpr, PREC: tl.constexpr,
                FAST: tl.constexpr):
    """Diagonal 16-row blocks of (<k_i e^{G_i-G_j}, k_j>, <q_i e^{G_i-G_j}, k_j>) over one K slice, as full [64, 64]
    tiles to be masked by the caller (same block; i > j / i >= j). Two tensor-core dots around each block's middle
    row when every |G - G_mid| <= 40 (K3's gate, lower bound -5: 8 steps at most), so no factor exceeds e^40 and
    the cross-block products are finite; otherwise exact, column by column."""
    r = tl.arange(0, 64)
    if tl.max(tl.max(tl.abs(G2 - Gmid2), 1), 0) <= 40. * LOG2E:
        rhs = tl.trans(kt * _exp2(Gmid2 - G2, FAST))
        e = _exp2(G2 - Gmid2, FAST)
        akk = tl.dot(kt * e, rhs, input_precision=PREC)
        aqk = tl.dot(qt * e, rhs, input_precision=PREC)
    else:
        akk = tl.zeros([64, 64], dtype=tl.float32)
        aqk = tl.zeros([64, 64], dtype=tl.float32)
        for j in range(64):
            kj = tl.load(kh + (t0 + j) * stride + oc, mask=(oc < K) & (j < nv), other=0.).to(tl.float32)
            same = (r // 16 == j // 16) & (r >= j)
            e = tl.exp2(tl.where(same[:, None], G2 - tl.load(pG + j * BK + oc)[None, :] * LOG2E, float("-inf")))
            col = r[None, :] == j
            akk = tl.where(col, tl.sum(kt * e * kj[None, :], 1)[:, None], akk)
            aqk = tl.where(col, tl.sum(qt * e * kj[None, :], 1)[:, None], aqk)
    return akk, aqk


@triton.jit
def _whole_chunk(pG, BK: tl.constexpr):
    """Whether every channel of the chunk whose G tile starts at pG spans at most 80 of log-decay, the test for the
    whole-chunk dots of the forward and backward intra kernels (factors within e^{+-40} around each channel's
    midpoint). G never rises, so a channel spans its first row's G minus its last's. Batch invariant: the chunk's
    own data."""
    ok = tl.arange(0, BK)
    return tl.max(tl.load(pG + ok) - tl.load(pG + 63 * BK + ok), 0) <= 80.


@triton.jit
def _whole_products(kh, qh, pG, t0, nv, stride, K, BK: tl.constexpr, BKS: tl.constexpr, PREC: tl.constexpr,
                    FAST: tl.constexpr):
    """(<k_i e^{G_i-G_j}, k_j>, <q_i e^{G_i-G_j}, k_j>) of a chunk whose channels each span at most 80 of log-decay:
    per K slice one pair of 64-row dots around each channel's midpoint, so no factor leaves [e^-40, e^40]. Each
    term is rounded relative to its own (bounded, i >= j) value, as in the 16-row blocks; the entries above the
    diagonal are finite and masked here."""
    r = tl.arange(0, 64)
    akk = tl.zeros([64, 64], dtype=tl.float32)
    aqk = tl.zeros([64, 64], dtype=tl.float32)
    for kc in range(0, BK, BKS):
        oc = kc + tl.arange(0, BKS)
        ref = (tl.load(pG + oc) + tl.load(pG + 63 * BK + oc)) * (0.5 * LOG2E)
        G = tl.load(pG + r[:, None] * BK + oc[None, :]) * LOG2E
        kt = _chunk_tile(kh, t0, nv, stride, oc, K)
        rhs = tl.trans(kt * _exp2(ref[None, :] - G, FAST))
        e = _exp2(G - ref[None, :], FAST)
        akk = tl.dot(kt * e, rhs, akk, input_precision=PREC)
        aqk = tl.dot(_chunk_tile(qh, t0, nv, stride, oc, K) * e, rhs, aqk, input_precision=PREC)
    return tl.where(r[:, None] > r[None, :], akk, 0.), tl.where(r[:, None] >= r[None, :], aqk, 0.)


@triton.jit
def _block_products(kh, qh, pG, t0, nv, stride, K, BK: tl.constexpr, BKS: tl.constexpr, PREC: tl.constexpr,
                    FAST: tl.constexpr):
    """`_whole_products` for any chunk: the off-diagonal 16-row blocks per column block J with both factors <= 1
    around G at J's last row, the diagonal blocks around their middle rows (`_diag_gated`)."""
    r = tl.arange(0, 64)
    blk = r // 16
    same = blk[:, None] == blk[None, :]
    akk = tl.zeros([64, 64], dtype=tl.float32)
    aqk = tl.zeros([64, 64], dtype=tl.float32)
    for kc in range(0, BK, BKS):
        oc = kc + tl.arange(0, BKS)
        kt = _chunk_tile(kh, t0, nv, stride, oc, K)
        qt = _chunk_tile(qh, t0, nv, stride, oc, K)
        G, Gend, Gmid = _gate_refs(pG, oc, BK)
        kRt = tl.trans(kt * _exp2(Gend - G, FAST))
        for J in tl.static_range(3):
            eJ = _later_factor(pG, G, oc, J, BK, FAST)
            rhs = tl.where((blk == J)[None, :], kRt, 0.)
            akk = tl.dot(kt * eJ, rhs, akk, input_precision=PREC)
            aqk = tl.dot(qt * eJ, rhs, aqk, input_precision=PREC)
        dkk, dqk = _diag_gated(kt, qt, G, Gmid, pG, kh, t0, nv, stride, oc, K, BK, PREC, FAST)
        akk += tl.where(same & (r[:, None] > r[None, :]), dkk, 0.)
        aqk += tl.where(same & (r[:, None] >= r[None, :]), dqk, 0.)
    return akk, aqk


@triton.jit
def _unit_lower_inverse(A, PREC: tl.constexpr):
    """(I + A)^-1 for a strictly lower 64 x 64 A. With D its 16 x 16 diagonal blocks and L = A - D:
    (I + D)^-1 = (I - D)(I + D^2)(I + D^4)(I + D^8) (D^16 = 0), N = (I + D)^-1 L has N^4 = 0, and
    (I + A)^-1 = (I - N)(I + N^2)(I + D)^-1: ten 64 x 64 x 64 dots, no 16-row tiles. Each factor (I + Y) is
    applied to the running product Z as Z + Y Z through the dot accumulator, so no identity tile is added."""
    r = tl.arange(0, 64)
    same = r[:, None] // 16 == r[None, :] // 16
    X = -tl.where(same, A, 0.)
    Dinv = tl.where(r[:, None] == r[None, :], 1., X)
    for _ in tl.static_range(3):
        X = tl.dot(X, X, input_precision=PREC)
        Dinv = tl.dot(Dinv, X, Dinv, input_precision=PREC)
    N = tl.dot(Dinv, tl.where(same, 0., A), input_precision=PREC)
    Z = tl.dot(N, tl.dot(N, Dinv, input_precision=PREC), Dinv, input_precision=PREC)
    return tl.dot(-N, Z, Z, input_precision=PREC)


@triton.jit
def _intra_chunk(v, beta, pG, Aqk, Kkk, Mc, Wc, Uc, QGc, KDc, scale, hv, t0, nv, base, qh, kh, H, HV, K, V,
                 BK: tl.constexpr, BKS: tl.constexpr, BVF: tl.constexpr, BVS: tl.constexpr, SAVE: tl.constexpr,
                 WHOLE: tl.constexpr, PREC: tl.constexpr, FAST: tl.constexpr):
    """`_fwd_intra`'s work for its chunk."""
    r = tl.arange(0, 64)
    if WHOLE:
        akk, aqk = _whole_products(kh, qh, pG, t0, nv, H * K, K, BK, BKS, PREC, FAST)
    else:
        akk, aqk = _block_products(kh, qh, pG, t0, nv, H * K, K, BK, BKS, PREC, FAST)
    pA = base * 4096 + r[:, None] * 64 + r[None, :]
    tl.store(Aqk + pA, (aqk * scale).to(Aqk.dtype.element_ty))
    if SAVE:  # the un-scaled <k_i e^{G_i-G_j}, k_j>, for dbeta in the backward
        tl.store(Kkk + pA, akk)
    b = tl.load(beta + (t0 + r) * HV + hv, mask=r < nv, other=0.).to(tl.float32)
    M = _unit_lower_inverse(akk * b[:, None], PREC)
    if SAVE:
        tl.store(Mc + pA, M)
    wt = Wc.dtype.element_ty
    Mw = M.to(wt)  # W and U take 16-bit operands with 16-bit inputs (as fla-core's recompute_w_u): stored as such
    for kc in range(0, BK, BKS):
        oc = kc + tl.arange(0, BKS)
        pK = base * 64 * BK + r[:, None] * BK + oc[None, :]
        kt = _chunk_tile(kh, t0, nv, H * K, oc, K)
        G = tl.load(pG + r[:, None] * BK + oc[None, :]) * LOG2E
        gC = tl.load(pG + 63 * BK + oc) * LOG2E
        eG = _exp2(G, FAST)
        tl.store(Wc + pK, tl.dot(Mw, (kt * eG * b[:, None]).to(wt), input_precision=PREC).to(wt))
        tl.store(KDc + pK, (kt * _exp2(gC[None, :] - G, FAST)).to(wt))
        tl.store(QGc + pK, (_chunk_tile(qh, t0, nv, H * K, oc, K) * scale * eG).to(wt))
    vh = v + hv * V
    for vc in range(0, BVF, BVS):
        ov = vc + tl.arange(0, BVS)
        vt = _chunk_tile(vh, t0, nv, HV * V, ov, V)
        tl.store(Uc + base * 64 * BVF + r[:, None] * BVF + ov[None, :],
                 tl.dot(Mw, (vt * b[:, None]).to(wt), input_precision=PREC).to(wt))


@triton.jit
def _fwd_intra(q, k, v, beta, Gc, Aqk, Kkk, Mc, Wc, Uc, QGc, KDc, cu, cidx, c_first, scale, H, HV, K, V,
               BK: tl.constexpr, BKS: tl.constexpr, BVF: tl.constexpr, BVS: tl.constexpr, SAVE: tl.constexpr,
               WHOLE: tl.constexpr, PREC: tl.constexpr, FAST: tl.constexpr):
    """Everything inside one chunk of one head with 64-row tensor-core dots: A and Aqk, M = (I + A)^-1, then
    W = M (beta k e^G), U = M (beta v), q e^G (scaled), k e^{G_C - G}. A launch does the chunks whose channels
    each span at most 80 of log-decay (`_whole_products`) when WHOLE, the others (`_block_products`) when not:
    the host launches both, each compiled for its path alone, and a program of the other kind returns at once.
    (H200, 16K: one kernel with both paths, 255 registers and spills, ran 0.95 ms on the benchmark's gate and
    1.10 on K3's safe gate; two launches 0.83 / 1.00, the whole-chunk one at 250 registers without spills; capped
    at 168 registers (`intra_whole_maxnreg`, 3 programs per multiprocessor instead of 2) 0.80.)"""
    hv, t0, nv, base, pG, qh, kh = _intra_program(q, k, Gc, cu, cidx, c_first, H, HV, K, BK)
    if _whole_chunk(pG, BK) == WHOLE:
        _intra_chunk(v, beta, pG, Aqk, Kkk, Mc, Wc, Uc, QGc, KDc, scale, hv, t0, nv, base, qh, kh, H, HV, K, V, BK,
                     BKS, BVF, BVS, SAVE, WHOLE, PREC, FAST)


@triton.jit
def _fwd_state(Wc, Uc, QGc, KDc, Aqk, Gc, o, h0, ht, Hc, VNc, cu, coff, seqs,
               HV, K, V, BK: tl.constexpr, BVF: tl.constexpr,
               BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, SAVE: tl.constexpr,
               NUM_STAGES: tl.constexpr, PREC: tl.constexpr):
    n = tl.load(seqs + tl.program_id(0)).to(tl.int64)  # this launch's sequences (`_state_classes`)
    hv = tl.program_id(1).to(tl.int64)
    iv = tl.program_id(2)
    bos = tl.load(cu + n).to(tl.int64)
    eos = tl.load(cu + n + 1).to(tl.int64)
    c0 = tl.load(coff + n).to(tl.int64)
    nt = (eos - bos + 63) // 64
    r = tl.arange(0, 64)
    ok = tl.arange(0, BK)
    km = ok < K
    ov = iv * BV + tl.arange(0, BV)
    vm = ov < V
    dt = Wc.dtype.element_ty
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + ((n * HV + hv) * K + ok[:, None]) * V + ov[None, :], mask=km[:, None] & vm[None, :],
                     other=0.)
    for t in tl.range(0, nt, num_stages=NUM_STAGES):
        base = (c0 + t) * HV + hv
        pK = base * 64 * BK + r[:, None] * BK + ok[None, :]
        pV = base * 64 * BVF + r[:, None] * BVF + ov[None, :]
        if SAVE:
            tl.store(Hc + base * BK * BVF + ok[:, None] * BVF + ov[None, :], S.to(Hc.dtype.element_ty))
        w = tl.load(Wc + pK)
        qg = tl.load(QGc + pK)
        kd = tl.load(KDc + pK)
        a = tl.load(Aqk + base * 64 * 64 + r[:, None] * 64 + r[None, :])
        u = tl.load(Uc + pV).to(tl.float32)
        gC = tl.load(Gc + base * 64 * BK + 63 * BK + ok)
        Sd = S.to(dt)
        vn = u - tl.dot(w, Sd, input_precision=PREC)
        if SAVE:
            tl.store(VNc + pV, vn.to(VNc.dtype.element_ty))
        vnd = vn.to(dt)
        out = tl.dot(qg, Sd, input_precision=PREC) + tl.dot(a, vnd, input_precision=PREC)
        tok = bos + t * 64 + r
        tl.store(o + (tok * HV + hv)[:, None] * V + ov[None, :], out.to(o.dtype.element_ty),
                 mask=(tok < eos)[:, None] & vm[None, :])
        S = S * tl.exp(gC)[:, None] + tl.dot(tl.trans(kd), vnd, input_precision=PREC)
    if STORE_HT:
        tl.store(ht + ((n * HV + hv) * K + ok[:, None]) * V + ov[None, :], S, mask=km[:, None] & vm[None, :])


@triton.jit
def _bwd_state(QGc, Wc, KDc, Aqk, Gc, do, dht, dh0, DHc, DVNc, cu, coff, seqs,
               HV, K, V, BK: tl.constexpr, BVF: tl.constexpr,
               BV: tl.constexpr, HAS_DHT: tl.constexpr, HAS_H0: tl.constexpr, NUM_STAGES: tl.constexpr,
               PREC: tl.constexpr):
    n = tl.load(seqs + tl.program_id(0)).to(tl.int64)  # this launch's sequences (`_state_classes`)
    hv = tl.program_id(1).to(tl.int64)
    iv = tl.program_id(2)
    bos = tl.load(cu + n).to(tl.int64)
    eos = tl.load(cu + n + 1).to(tl.int64)
    c0 = tl.load(coff + n).to(tl.int64)
    nt = (eos - bos + 63) // 64
    r = tl.arange(0, 64)
    ok = tl.arange(0, BK)
    km = ok < K
    ov = iv * BV + tl.arange(0, BV)
    vm = ov < V
    dt = Wc.dtype.element_ty
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        dS += tl.load(dht + ((n * HV + hv) * K + ok[:, None]) * V + ov[None, :], mask=km[:, None] & vm[None, :],
                      other=0.)
    for i in tl.range(0, nt, num_stages=NUM_STAGES):
        t = nt - 1 - i
        base = (c0 + t) * HV + hv
        pK = base * 64 * BK + r[:, None] * BK + ok[None, :]
        tl.store(DHc + base * BK * BVF + ok[:, None] * BVF + ov[None, :], dS.to(DHc.dtype.element_ty))
        qg = tl.load(QGc + pK)
        w = tl.load(Wc + pK)
        kd = tl.load(KDc + pK)
        a = tl.load(Aqk + base * 64 * 64 + r[:, None] * 64 + r[None, :])
        gC = tl.load(Gc + base * 64 * BK + 63 * BK + ok)
        tok = bos + t * 64 + r
        dO = tl.load(do + (tok * HV + hv)[:, None] * V + ov[None, :], mask=(tok < eos)[:, None] & vm[None, :],
                     other=0.).to(dt)
        dSd = dS.to(dt)
        dvn = tl.dot(tl.trans(a), dO, input_precision=PREC) + tl.dot(kd, dSd, input_precision=PREC)
        tl.store(DVNc + base * 64 * BVF + r[:, None] * BVF + ov[None, :], dvn.to(DVNc.dtype.element_ty))
        dS = dS * tl.exp(gC)[:, None] + tl.dot(tl.trans(qg), dO, input_precision=PREC) - \
            tl.dot(tl.trans(w), dvn.to(dt), input_precision=PREC)
    if HAS_H0:
        tl.store(dh0 + ((n * HV + hv) * K + ok[:, None]) * V + ov[None, :], dS, mask=km[:, None] & vm[None, :])


@triton.jit
def _bwd_prep(q, k, v, beta, do, Gc, Kkk, Mc, Hc, DHc, VNc, DVNc, dv, Rs, Ps, DQs, DKs, DGs, dbeta, cu, cidx, scale,
              H, HV, K, V, BK: tl.constexpr, KA: tl.constexpr, BVF: tl.constexpr, BV: tl.constexpr,
              PREC: tl.constexpr):
    """Full-chunk products: dv, dbeta, R = dAqk, P = dA = -M^T dM M^T, and the direct parts of dq, dk, dG."""
    c = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1).to(tl.int64)
    h = hv // (HV // H)
    _, t0, nv = _chunk_rows(cu, cidx, c)
    base = c * HV + hv
    r = tl.arange(0, 64)
    rm = r < nv
    pG = Gc + base * 64 * BK
    pR = Rs + base * 64 * 64
    pP = Ps + base * 64 * 64
    # products over V only (dAqk, dM's value part, dv, dbeta's value part). Products of two stored 16-bit tensors
    # take them as they are (exact products, fp32 sums, twice the tensor-core rate of tf32 on upcast copies)
    M = tl.load(Mc + base * 64 * 64 + r[:, None] * 64 + r[None, :])
    bt = tl.load(beta + (t0 + r) * HV + hv, mask=rm, other=0.).to(tl.float32)
    dAqk = tl.zeros([64, 64], dtype=tl.float32)
    dMv = tl.zeros([64, 64], dtype=tl.float32)
    db = tl.zeros([64], dtype=tl.float32)
    for iv in range(BVF // BV):
        ov = iv * BV + tl.arange(0, BV)
        mrv = rm[:, None] & (ov < V)[None, :]
        pV = base * 64 * BVF + r[:, None] * BVF + ov[None, :]
        vn = tl.load(VNc + pV)
        dvn = tl.load(DVNc + pV)
        dO = tl.load(do + ((t0 + r) * HV + hv)[:, None] * V + ov[None, :], mask=mrv, other=0.).to(vn.dtype)
        vv = tl.load(v + ((t0 + r) * HV + hv)[:, None] * V + ov[None, :], mask=mrv, other=0.).to(vn.dtype)
        dAqk = tl.dot(dO, tl.trans(vn), dAqk, input_precision=PREC)
        dMv = tl.dot(dvn, tl.trans(vv), dMv, input_precision=PREC)
        dbv = tl.dot(tl.trans(M), dvn.to(tl.float32), input_precision=PREC)
        tl.store(dv + ((t0 + r) * HV + hv)[:, None] * V + ov[None, :], (dbv * bt[:, None]).to(dv.dtype.element_ty),
                 mask=mrv)
        db += tl.sum(vv.to(tl.float32) * dbv, 1)
    tl.store(pR + r[:, None] * 64 + r[None, :], tl.where(r[:, None] >= r[None, :], dAqk, 0.))
    dM = dMv * bt[None, :]
    # per K slice, products with the states (dqg = dO S^T, dW = -dv' S^T, dkd = v' dS^T)
    for kc in range(0, BK, KA):
        oc = kc + tl.arange(0, KA)
        mrc = rm[:, None] & (oc < K)[None, :]
        dqg = tl.zeros([64, KA], dtype=tl.float32)
        dW = tl.zeros([64, KA], dtype=tl.float32)
        dkd = tl.zeros([64, KA], dtype=tl.float32)
        dgc = tl.zeros([KA], dtype=tl.float32)
        for iv in range(BVF // BV):
            ov = iv * BV + tl.arange(0, BV)
            pS = base * BK * BVF + oc[:, None] * BVF + ov[None, :]
            pV = base * 64 * BVF + r[:, None] * BVF + ov[None, :]
            S = tl.load(Hc + pS)
            dS = tl.load(DHc + pS)
            vn = tl.load(VNc + pV)
            dvn = tl.load(DVNc + pV)
            dO = tl.load(do + ((t0 + r) * HV + hv)[:, None] * V + ov[None, :],
                         mask=rm[:, None] & (ov < V)[None, :], other=0.).to(vn.dtype)
            dqg = tl.dot(dO, tl.trans(S), dqg, input_precision=PREC)
            dW = tl.dot(dvn, tl.trans(S), dW, input_precision=PREC)
            dkd = tl.dot(vn, tl.trans(dS), dkd, input_precision=PREC)
            dgc += tl.sum(S.to(tl.float32) * dS.to(tl.float32), 1)
        dW = -dW
        G = tl.load(pG + r[:, None] * BK + oc[None, :])
        gC = tl.load(pG + 63 * BK + oc)
        kk = tl.load(k + ((t0 + r) * H + h)[:, None] * K + oc[None, :], mask=mrc, other=0.).to(tl.float32)
        qq = tl.load(q + ((t0 + r) * H + h)[:, None] * K + oc[None, :], mask=mrc, other=0.).to(tl.float32) * scale
        eG = tl.exp(G)
        kgw = kk * eG
        dM += tl.dot(dW, tl.trans(kgw * bt[:, None]), input_precision=PREC)
        dbkg = tl.dot(tl.trans(M), dW, input_precision=PREC)
        db += tl.sum(kgw * dbkg, 1)
        eC = tl.exp(gC[None, :] - G)
        kd = kk * eC
        dgc = dgc * tl.exp(gC) + tl.sum(dkd * kd, 0)
        pK = base * 64 * BK + r[:, None] * BK + oc[None, :]
        tl.store(DQs + pK, dqg * eG)
        tl.store(DKs + pK, dbkg * bt[:, None] * eG + dkd * eC)
        dG = dqg * qq * eG + dbkg * bt[:, None] * kgw - dkd * kd + tl.where(r[:, None] == 63, dgc[None, :], 0.)
        tl.store(DGs + pK, dG)
    dA = -tl.dot(tl.dot(tl.trans(M), dM, input_precision=PREC), tl.trans(M), input_precision=PREC)
    dA = tl.where(r[:, None] > r[None, :], dA, 0.)
    tl.store(pP + r[:, None] * 64 + r[None, :], dA)
    db += tl.sum(dA * tl.load(Kkk + base * 4096 + r[:, None] * 64 + r[None, :]), 1)  # A = beta_i Kkk
    tl.store(dbeta + (t0 + r) * HV + hv, db.to(dbeta.dtype.element_ty), mask=rm)


@triton.jit
def _row(X, j):
    """Row j of a [16, n] register tile, as an [n] vector."""
    return tl.sum(tl.where(tl.arange(0, 16)[:, None] == j, X, 0.), 0)


@triton.jit
def _rounded(x, PREC: tl.constexpr):
    """x as the tensor cores read it in a TF32 dot (round to nearest, ties away): an operand passed rounded is read
    unchanged, so the same rounded values can weight both sides of a gradient pair (see `_off_grad`)."""
    if PREC == "tf32":
        return ((x.to(tl.uint32, bitcast=True) + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)
    else:
        return x


@triton.jit
def _off_grad(R, PB, qI, kI, GI, gI, kJ, GJ, PREC: tl.constexpr):
    """Gradients through one off-diagonal block (I > J) of Aqk (R = dAqk) and A (PB = beta_i dA_ij) over one K slice,
    around gI (block I's first row, so no exponent is positive), with a_I = q_I e^{G_I-gI} (k_I for PB) and
    b_J = k_J e^{gI-G_J} rounded as the dots read them. Returns the row parts R b_J, PB b_J (block I's dq / dk and dG
    rows once scaled by the caller), the column part e^{gI-G_J} (R^T a_I + PB^T a_I') of dk_J, and its dG_J term
    b_J (R^T a_I + PB^T a_I'). Each pair (i, j) adds the same a_i R_ij b_j to dG_i and subtracts it from dG_j, and the
    reverse cumsum over tokens cancels the two: with one rounding of a and b for both sides the cancellation is
    exact to fp32 (with independent roundings TF32 left dg / ddt_bias far off under strong decay)."""
    eJ = tl.exp(gI[None, :] - GJ)
    eI = tl.exp(GI - gI[None, :])
    b = _rounded(kJ * eJ, PREC)
    cs = tl.dot(tl.trans(R), _rounded(qI * eI, PREC), input_precision=PREC) + \
        tl.dot(tl.trans(PB), _rounded(kI * eI, PREC), input_precision=PREC)
    return tl.dot(R, b, input_precision=PREC), tl.dot(PB, b, input_precision=PREC), eJ * cs, b * cs


@triton.jit
def _off_acc(xR, xP, c, d, R, PB, qI, kI, GI, gI, kJ, GJ, PREC: tl.constexpr):
    """`_off_grad` of block (I, J) added to row block I's and column block J's running sums."""
    a, b, cx, dx = _off_grad(R, PB, qI, kI, GI, gI, kJ, GJ, PREC)
    return xR + a, xP + b, c + cx, d + dx


@triton.jit
def _pair_grads(Rd, Rs, PB, q, k, G, ref, PREC: tl.constexpr):
    """Gradients through the gated pairs of one row range over one K slice, by dots around a per-channel reference
    `ref` (the caller keeps every |G - ref| small enough for e^{+-(G - ref)}): Rs = R strictly lower, Rd = R's
    diagonal [n, 1] (a token with itself: in fp32 outside the dots, its dG terms cancel exactly, so they are left
    out), PB strictly lower. The operands are rounded once (`_rounded`) and weight both sides of each pair. Returns
    the row parts sum_j (R, PB)_ij k_j e^{G_i-G_j}, the column part sum_i (R_ij q_i + PB_ij k_i) e^{G_i-G_j} and the
    dG terms."""
    e = tl.exp(G - ref[None, :])
    ei = tl.exp(ref[None, :] - G)
    b = _rounded(k * ei, PREC)
    aq = _rounded(q * e, PREC)
    ak = _rounded(k * e, PREC)
    Rb = tl.dot(Rs, b, input_precision=PREC)
    Pb = tl.dot(PB, b, input_precision=PREC)
    cs = tl.dot(tl.trans(Rs), aq, input_precision=PREC) + tl.dot(tl.trans(PB), ak, input_precision=PREC)
    return e * Rb + Rd * k, e * Pb, ei * cs + Rd * q, aq * Rb + ak * Pb - b * cs


@triton.jit
def _diag_grad(R, PB, qb, kb, Gb, PREC: tl.constexpr):
    """Gradients through a diagonal block (R lower, PB strictly lower) over one K slice: row parts
    sum_j (R, PB)_ij k_j e^{G_i-G_j}, the column part sum_i (R_ij q_i + PB_ij k_i) e^{G_i-G_j}, and the block's dG
    terms; by dots around the middle row when |G - G_mid| <= 80 in the tile (operands rounded once, as in
    `_off_grad`; R's diagonal, token with itself, in fp32 outside the dots: its dG terms cancel exactly, so they are
    left out), else exactly, column by column."""
    c16 = tl.arange(0, 16)
    gm = _row(Gb, 8)
    if tl.max(tl.max(tl.abs(Gb - gm[None, :]), 1), 0) <= 80.:
        rowR, rowP, col, dG = _pair_grads(tl.sum(tl.where(c16[:, None] == c16[None, :], R, 0.), 1)[:, None],
                                          tl.where(c16[:, None] > c16[None, :], R, 0.), PB, qb, kb, Gb, gm, PREC)
    else:
        rowR = tl.zeros_like(kb)
        rowP = tl.zeros_like(kb)
        col = tl.zeros_like(kb)
        for j in range(16):
            e = tl.exp(tl.where(c16[:, None] >= j, Gb - _row(Gb, j)[None, :], float("-inf")))
            Rj = tl.sum(tl.where(c16[None, :] == j, R, 0.), 1)
            Pj = tl.sum(tl.where(c16[None, :] == j, PB, 0.), 1)
            kj = _row(kb, j)[None, :]
            rowR += Rj[:, None] * kj * e
            rowP += Pj[:, None] * kj * e
            col = tl.where(c16[:, None] == j, tl.sum((Rj[:, None] * qb + Pj[:, None] * kb) * e, 0)[None, :], col)
        dG = qb * rowR + kb * (rowP - col)
    return rowR, rowP, col, dG


@triton.jit
def _bwd_out(DQs, DKs, DGs, dq, dk, dg, base, t0, rows, nv, hv, HV, K, oc, scale, BK: tl.constexpr, rowR, rowP, col,
             dGi, tail):
    """Finish one 16-row block: dq, dk, and dg = reverse cumsum over the chunk of dG (tail = column sums of the later
    blocks' dG); returns the new tail."""
    pb = base * 64 * BK + rows[:, None] * BK + oc[None, :]
    dG = tl.load(DGs + pb) + dGi
    po = ((t0 + rows) * HV + hv)[:, None] * K + oc[None, :]
    m = (rows < nv)[:, None] & (oc < K)[None, :]
    tl.store(dq + po, ((tl.load(DQs + pb) + rowR) * scale).to(dq.dtype.element_ty), mask=m)
    tl.store(dk + po, (tl.load(DKs + pb) + rowP + col).to(dk.dtype.element_ty), mask=m)
    tl.store(dg + po, (tl.cumsum(dG, 0, reverse=True) + tail[None, :]).to(dg.dtype.element_ty), mask=m)
    return tail + tl.sum(dG, 0)


@triton.jit
def _bwd_block(DQs, DKs, DGs, dq, dk, dg, base, t0, rows, nv, hv, HV, K, oc, scale, BK: tl.constexpr, R, PB, qb, kb, Gb,
               gb, xR, xP, c, d, tail, PREC: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr):
    """One 16-row block, last to first: its diagonal block (`_diag_grad`), plus (ROW) the row parts xR, xP that
    `_off_grad` collected from the earlier column blocks, scaled by e^{G - gb} (gb: the block's first row), and
    (COL) the column parts c, d of the later row blocks; then `_bwd_out`."""
    rR, rP, cx, dG = _diag_grad(R, PB, qb, kb, Gb, PREC)
    if ROW:
        e = tl.exp(Gb - gb[None, :])
        rR += xR * e
        rP += xP * e
        up = _rounded(qb * e, PREC) * xR + _rounded(kb * e, PREC) * xP
        if COL:
            dG += up - d
        else:
            dG += up
    elif COL:
        dG = dG - d
    if COL:
        cx += c
    return _bwd_out(DQs, DKs, DGs, dq, dk, dg, base, t0, rows, nv, hv, HV, K, oc, scale, BK, rR, rP, cx, dG, tail)


@triton.jit
def _bwd_whole(beta, Rs, Ps, DQs, DKs, DGs, dq, dk, dg, scale, HV, K, hv, t0, nv, base, pG, qh, kh, H,
               BK: tl.constexpr, BKS: tl.constexpr, PREC: tl.constexpr):
    """`_bwd_intra` for a chunk whose log-decay spans at most 80 in every channel: each K slice as 64-row
    `_pair_grads` around the channel's midpoint (every factor within e^{+-40}), as `_diag_grad` does for one
    16-row block."""
    r = tl.arange(0, 64)
    pA = base * 4096 + r[:, None] * 64 + r[None, :]
    lower = r[:, None] > r[None, :]
    R = tl.load(Rs + pA)
    Rd = tl.sum(tl.where(r[:, None] == r[None, :], R, 0.), 1)[:, None]
    Rl = tl.where(lower, R, 0.)
    bt = tl.load(beta + (t0 + r) * HV + hv, mask=r < nv, other=0.).to(tl.float32)
    PB = tl.where(lower, tl.load(Ps + pA), 0.) * bt[:, None]
    for kc in range(0, BK, BKS):
        oc = kc + tl.arange(0, BKS)
        kt = _chunk_tile(kh, t0, nv, H * K, oc, K)
        qt = _chunk_tile(qh, t0, nv, H * K, oc, K) * scale
        G = tl.load(pG + r[:, None] * BK + oc[None, :])
        rowR, rowP, col, dG = _pair_grads(Rd, Rl, PB, qt, kt, G, (tl.max(G, 0) + tl.min(G, 0)) * 0.5, PREC)
        _bwd_out(DQs, DKs, DGs, dq, dk, dg, base, t0, r, nv, hv, HV, K, oc, scale, BK, rowR, rowP, col, dG,
                 tl.zeros([BKS], dtype=tl.float32))


@triton.jit
def _bwd_blocks(beta, Rs, Ps, DQs, DKs, DGs, dq, dk, dg, scale, HV, K, hv, t0, nv, base, pG, qh, kh, H,
                BK: tl.constexpr, BKS: tl.constexpr, PREC: tl.constexpr):
    """`_bwd_intra` for any chunk: 4 x 4 blocks of 16, each factor around a block's first or middle row."""
    c16 = tl.arange(0, 16)
    r0, r1, r2, r3 = c16, 16 + c16, 32 + c16, 48 + c16
    o = c16[:, None] * 64 + c16[None, :]
    pR = Rs + base * 4096 + o
    pP = Ps + base * 4096 + o
    pb = beta + t0 * HV + hv
    b1 = tl.load(pb + r1 * HV, mask=r1 < nv, other=0.).to(tl.float32)[:, None]
    b2 = tl.load(pb + r2 * HV, mask=r2 < nv, other=0.).to(tl.float32)[:, None]
    b3 = tl.load(pb + r3 * HV, mask=r3 < nv, other=0.).to(tl.float32)[:, None]
    b0 = tl.load(pb + r0 * HV, mask=r0 < nv, other=0.).to(tl.float32)[:, None]
    R00, R11, R22, R33 = tl.load(pR), tl.load(pR + 1040), tl.load(pR + 2080), tl.load(pR + 3120)
    R10, R20, R21 = tl.load(pR + 1024), tl.load(pR + 2048), tl.load(pR + 2064)
    R30, R31, R32 = tl.load(pR + 3072), tl.load(pR + 3088), tl.load(pR + 3104)
    P00, P11, P22, P33 = tl.load(pP) * b0, tl.load(pP + 1040) * b1, tl.load(pP + 2080) * b2, tl.load(pP + 3120) * b3
    P10, P20, P21 = tl.load(pP + 1024) * b1, tl.load(pP + 2048) * b2, tl.load(pP + 2064) * b2
    P30, P31, P32 = tl.load(pP + 3072) * b3, tl.load(pP + 3088) * b3, tl.load(pP + 3104) * b3
    for kc in range(0, BK, BKS):
        oc = kc + tl.arange(0, BKS)
        pGs = pG + oc[None, :]
        k0 = _tile(kh, t0, r0, nv, H * K, oc, K)
        k1 = _tile(kh, t0, r1, nv, H * K, oc, K)
        k2 = _tile(kh, t0, r2, nv, H * K, oc, K)
        k3 = _tile(kh, t0, r3, nv, H * K, oc, K)
        q0 = _tile(qh, t0, r0, nv, H * K, oc, K) * scale
        q1 = _tile(qh, t0, r1, nv, H * K, oc, K) * scale
        q2 = _tile(qh, t0, r2, nv, H * K, oc, K) * scale
        q3 = _tile(qh, t0, r3, nv, H * K, oc, K) * scale
        G0 = tl.load(pGs + r0[:, None] * BK)
        G1 = tl.load(pGs + r1[:, None] * BK)
        G2 = tl.load(pGs + r2[:, None] * BK)
        G3 = tl.load(pGs + r3[:, None] * BK)
        g1 = tl.load(pG + 16 * BK + oc)
        g2 = tl.load(pG + 32 * BK + oc)
        g3 = tl.load(pG + 48 * BK + oc)
        # off-diagonal blocks (I > J): row parts of block I collected before their common factor e^{G_I - g_I}
        # (xR, xP); column parts of block J for dk (c) and their dG terms (d)
        xR1, xP1, c0, d0 = _off_grad(R10, P10, q1, k1, G1, g1, k0, G0, PREC)
        xR2, xP2, c1, d1 = _off_grad(R21, P21, q2, k2, G2, g2, k1, G1, PREC)
        xR2, xP2, c0, d0 = _off_acc(xR2, xP2, c0, d0, R20, P20, q2, k2, G2, g2, k0, G0, PREC)
        xR3, xP3, c2, d2 = _off_grad(R32, P32, q3, k3, G3, g3, k2, G2, PREC)
        xR3, xP3, c0, d0 = _off_acc(xR3, xP3, c0, d0, R30, P30, q3, k3, G3, g3, k0, G0, PREC)
        xR3, xP3, c1, d1 = _off_acc(xR3, xP3, c1, d1, R31, P31, q3, k3, G3, g3, k1, G1, PREC)
        tail = tl.zeros([BKS], dtype=tl.float32)
        tail = _bwd_block(DQs, DKs, DGs, dq, dk, dg, base, t0, r3, nv, hv, HV, K, oc, scale, BK, R33, P33, q3, k3, G3,
                          g3, xR3, xP3, c2, d2, tail, PREC, True, False)
        tail = _bwd_block(DQs, DKs, DGs, dq, dk, dg, base, t0, r2, nv, hv, HV, K, oc, scale, BK, R22, P22, q2, k2, G2,
                          g2, xR2, xP2, c2, d2, tail, PREC, True, True)
        tail = _bwd_block(DQs, DKs, DGs, dq, dk, dg, base, t0, r1, nv, hv, HV, K, oc, scale, BK, R11, P11, q1, k1, G1,
                          g1, xR1, xP1, c1, d1, tail, PREC, True, True)
        tail = _bwd_block(DQs, DKs, DGs, dq, dk, dg, base, t0, r0, nv, hv, HV, K, oc, scale, BK, R00, P00, q0, k0, G0,
                          g1, xR1, xP1, c0, d0, tail, PREC, False, True)


@triton.jit
def _bwd_intra(q, k, beta, Gc, Rs, Ps, DQs, DKs, DGs, dq, dk, dg, cu, cidx, scale, H, HV, K, BK: tl.constexpr,
               BKS: tl.constexpr, PREC: tl.constexpr):
    """Gradients through A (P = dA) and Aqk (R = dAqk) for one chunk of one head, one K slice at a time, added to
    the direct parts from `_bwd_prep`; writes dq, dk, dg (reverse in-chunk cumsum). A chunk whose log-decay spans
    at most 80 in every channel (the span's test is the chunk's own data: batch invariant) takes 64-row dots
    (`_bwd_whole`), any other the 16-row blocks (`_bwd_blocks`)."""
    hv, t0, nv, base, pG, qh, kh = _intra_program(q, k, Gc, cu, cidx, 0, H, HV, K, BK)
    if _whole_chunk(pG, BK):
        _bwd_whole(beta, Rs, Ps, DQs, DKs, DGs, dq, dk, dg, scale, HV, K, hv, t0, nv, base, pG, qh, kh, H, BK, BKS,
                   PREC)
    else:
        _bwd_blocks(beta, Rs, Ps, DQs, DKs, DGs, dq, dk, dg, scale, HV, K, hv, t0, nv, base, pG, qh, kh, H, BK, BKS,
                    PREC)


def _p2(x: int) -> int:
    return max(16, next_pow2(x))


def _prec(dtype: torch.dtype, kernel: str | None = None) -> str:
    """fp32 dot precision: CONFIG["dot_precision"] if set; else near-fp32 (3xTF32) for fp32 inputs; for 16-bit
    inputs CONFIG["<kernel>_precision"] where set, else TF32 (the backward intra kernel rounds its operands once for
    both sides of each gradient pair, `_rounded`, which is what makes TF32 accurate enough there)."""
    if CONFIG["dot_precision"] is not None:
        return CONFIG["dot_precision"]
    if dtype == torch.float32:
        return "tf32x3"
    return (CONFIG.get(f"{kernel}_precision") if kernel else None) or "tf32"


def _state_split(direction: str, states: int, K: int, V: int, BVF: int, device: torch.device) -> tuple[int, int]:
    """(V block, pipeline stages) of the serial state pass, one program per (sequence, head, V block). Every
    program reloads its chunk's [64, K] operands, so wider blocks cut that traffic and narrower ones add programs:
    the widest block that still gives half the multiprocessors a program. H200, state-pass ms by V block 16 / 32 /
    64: B1 H16 T16K fwd 0.27 / 0.32 / 0.57, bwd 0.27 / 0.35 / 0.56; 8 packed sequences (32K tokens) fwd 1.15 /
    0.65 / 0.65, bwd 1.52 / 0.84 / 0.69; B4 H16 T8K fwd 0.86 / 0.40 / 0.33, bwd 1.15 / 0.51 / 0.35. CONFIG's
    `<direction>_state_bv` overrides it (the benchmark's sweep)."""
    forced = CONFIG[f"{direction}_state_bv"]
    if forced is not None:
        return min(forced, BVF), CONFIG[f"{direction}_state_stages"]
    sms = num_sms(device)  # (state tiles no larger than the measured [128, 64]: K > 128 keeps them narrower)
    bv = next((b for b in (64, 32) if 2 * states * cdiv(V, b) >= sms and _p2(K) * b <= 128 * 64), 16)
    return min(bv, BVF), (2 if bv == 64 else CONFIG[f"{direction}_state_stages"])


@functools.lru_cache(maxsize=32)
def _chunk_plan(cu: tuple[int, ...] | None, B: int, T: int, device: torch.device) -> tuple:
    """(cu_seqlens int64 [N+1], chunk -> (sequence, chunk in sequence) int32 [NC, 2], each sequence's first chunk
    int32 [N], the sequence classes of `_state_classes` as (sequences int32, count, first chunk, chunks)), cached by
    content: every KDA layer of a model step sees the same batch, and building a packed plan of 8 sequences / 512
    chunks costs ~0.1 ms of host time. Chunks are numbered class by class, so that a class's chunks are one range
    for the forward's per-class launches (`_fwd`). Fixed-length batches are built on the device (no host sync),
    packed ones from the host tuple. The kernels only read it."""
    if cu is None:
        nt = cdiv(T, BT)
        c = torch.arange(B * nt, device=device, dtype=torch.int32)
        return (torch.arange(B + 1, device=device, dtype=torch.int64) * T,
                torch.stack([c // nt, c % nt], 1).contiguous(),
                torch.arange(B, device=device, dtype=torch.int32) * nt,
                ((torch.arange(B, device=device, dtype=torch.int32), B, 0, B * nt),))
    counts = [cdiv(cu[i + 1] - cu[i], BT) for i in range(len(cu) - 1)]
    pairs, first, classes = [], [0] * len(counts), []
    for group in _state_classes(counts, CONFIG["state_classes"]):
        start = len(pairs)
        for i in group:
            first[i] = len(pairs)
            pairs.extend((i, t) for t in range(counts[i]))
        classes.append((torch.tensor(group, dtype=torch.int32).to(device, non_blocking=True), len(group), start,
                        len(pairs) - start))
    cidx = torch.tensor(pairs, dtype=torch.int32).view(-1, 2)
    return tuple(x.to(device, non_blocking=True) for x in (torch.tensor(cu, dtype=torch.int64), cidx,
                                                           torch.tensor(first, dtype=torch.int32))) + (tuple(classes),)


def _state_classes(chunks: list[int], most: int) -> list[list[int]]:
    """Sequences grouped by length for the serial state passes, longest first: each class holds the sequences at
    least half as long as its longest (their chains set the pass's time), at most `most` classes, the last taking
    every sequence left (empty ones too: they still get their state, h0 -> ht). Each class gets its own V block
    (`_state_split`): a long sequence keeps narrow blocks and many programs per head, many short ones take wide
    blocks that reload their operands fewer times; the forward starts a class's pass as soon as its own intra work
    is done (`_fwd`), the backward runs all classes' passes at once (`_bwd`). Outputs do not depend on the grouping
    (bitwise, any V block)."""
    left = [i for i, c in enumerate(chunks) if c > 0]
    classes = []
    while left and len(classes) < most - 1:
        longest = max(chunks[i] for i in left)
        top = [i for i in left if 2 * chunks[i] >= longest]
        if len(top) == len(left):
            break
        classes.append(top)
        left = [i for i in left if 2 * chunks[i] < longest]
    rest = sorted(left + [i for i, c in enumerate(chunks) if c == 0])
    return classes + ([rest] if rest else [])


_STREAMS: dict = {}


def _side_stream(device: torch.device, index: int) -> torch.cuda.Stream:
    """The device's high-priority side stream number `index`, made once (its blocks are placed first as
    multiprocessors free up)."""
    if (device, index) not in _STREAMS:
        _STREAMS[device, index] = torch.cuda.Stream(device, priority=-1)
    return _STREAMS[device, index]


@contextlib.contextmanager
def _forked(fork: bool, device: torch.device, index: int):
    """With `fork` (on CUDA), launches inside go to side stream `index`, after the work queued so far; the caller
    joins it (`_join`) once its own later launches are queued, so they overlap. Otherwise (and in the CPU
    interpreter) they stay on the current stream."""
    if not fork or device.type != "cuda":
        yield
        return
    side = _side_stream(device, index)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        yield


def _join(device: torch.device, forks: int) -> None:
    """The current stream waits for side streams 0 .. forks-1 (`_forked`)."""
    for i in range(forks):
        torch.cuda.current_stream(device).wait_stream(_side_stream(device, i))


def _fwd(q, k, v, g, beta, scale, h0, want_ht, gate, A_log, dt_bias, lower_bound, plan, save):
    cu, cidx, coff, classes = plan
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    N, NC = coff.numel(), cidx.shape[0]
    BK, BVF = _p2(K), _p2(V)
    KA = min(CONFIG["ka"], BK, BVF)
    dev, dt, f32, prec = q.device, k.dtype, torch.float32, _prec(k.dtype)
    Gc = torch.empty(NC, HV, BT, BK, device=dev, dtype=f32)
    Kkk = torch.empty(NC, HV, BT, BT, device=dev, dtype=f32) if save else None
    Mc = torch.empty(NC, HV, BT, BT, device=dev, dtype=f32) if save else None
    Aqk = torch.empty(NC, HV, BT, BT, device=dev, dtype=dt)
    Wc, QGc, KDc = (torch.empty(NC, HV, BT, BK, device=dev, dtype=dt) for _ in range(3))
    Uc = torch.empty(NC, HV, BT, BVF, device=dev, dtype=dt)
    dummy = Gc
    o = torch.empty_like(v)
    ht = torch.empty(N, HV, K, V, device=dev, dtype=f32) if want_ht else None
    Hc = torch.empty(NC, HV, BK, BVF, device=dev, dtype=dt) if save else None
    VNc = torch.empty(NC, HV, BT, BVF, device=dev, dtype=dt) if save else None
    forks = len(classes) - 1 if dev.type == "cuda" else 0  # every class's pass but the last one's is forked
    for i, (seqs, count, c_first, chunks) in enumerate(classes):
        if chunks:  # a class of empty sequences only has no chunk work, just its state pass (h0 -> ht)
            _fwd_cumsum[(chunks, HV, BK // KA)](
                g, A_log if A_log is not None else dummy, dt_bias if dt_bias is not None else dummy, Gc, cu, cidx,
                c_first, float(lower_bound) if lower_bound is not None else 0., HV, K, BK=BK, KA=KA, GATE=gate,
                HAS_A=A_log is not None, HAS_DT=dt_bias is not None, num_warps=4)
            for whole in (True, False):  # each chunk's program works in one of the two launches
                launch = "intra_whole" if whole else "intra"
                cap = CONFIG[f"{launch}_maxnreg"] if dev.type == "cuda" else None  # register cap (None: none)
                _fwd_intra[(chunks, HV)](
                    q, k, v, beta, Gc, Aqk, Kkk if save else dummy, Mc if save else dummy, Wc, Uc, QGc, KDc, cu, cidx,
                    c_first, scale, H, HV, K, V, BK=BK, BKS=min(CONFIG["intra_bk"], BK),
                    BVS=min(CONFIG["intra_bk"], BVF), BVF=BVF, SAVE=save, WHOLE=whole, PREC=prec,
                    FAST=dev.type == "cuda", num_warps=CONFIG[f"{launch}_warps"],
                    num_stages=CONFIG[f"{launch}_stages"], **({"maxnreg": cap} if cap else {}))
        BV, stages = _state_split("fwd", count * HV, K, V, BVF, dev)
        if forks:
            which = "forked" if i < forks else "rest"
            BV = min(CONFIG[f"fwd_state_{which}_bv"] or BV, BVF)
            stages = CONFIG[f"fwd_state_{which}_stages"] or stages
        with _forked(i < forks, dev, i):
            _fwd_state[(count, HV, cdiv(V, BV))](
                Wc, Uc, QGc, KDc, Aqk, Gc, o, h0 if h0 is not None else dummy, ht if ht is not None else dummy,
                Hc if save else dummy, VNc if save else dummy, cu, coff, seqs, HV=HV, K=K, V=V, BK=BK, BVF=BVF,
                BV=BV, HAS_H0=h0 is not None, STORE_HT=want_ht, SAVE=save, NUM_STAGES=stages, PREC=prec,
                num_warps=CONFIG["fwd_state_warps"])
    _join(dev, forks)
    return o, ht, (Gc, Kkk, Mc, Aqk, Wc, QGc, KDc, Hc, VNc)


def _bwd(q, k, v, beta, do, dht, has_h0, scale, saved, plan):
    cu, cidx, coff, classes = plan
    Gc, Kkk, Mc, Aqk, Wc, QGc, KDc, Hc, VNc = saved
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N, NC = coff.numel(), cidx.shape[0]
    BK, BVF = _p2(K), _p2(V)
    KA = min(CONFIG["ka"], BK)
    dev, dt, f32, prec = q.device, k.dtype, torch.float32, _prec(k.dtype)
    DHc = torch.empty(NC, HV, BK, BVF, device=dev, dtype=dt)
    DVNc = torch.empty(NC, HV, BT, BVF, device=dev, dtype=dt)
    dh0 = torch.empty(N, HV, K, V, device=dev, dtype=f32) if has_h0 else None
    forks = len(classes) - 1 if dev.type == "cuda" else 0  # all classes' passes at once, the longest first
    for i, (seqs, count, _, _) in enumerate(classes):
        BV, stages = _state_split("bwd", count * HV, K, V, BVF, dev)
        with _forked(i < forks, dev, i):
            _bwd_state[(count, HV, cdiv(V, BV))](
                QGc, Wc, KDc, Aqk, Gc, do, dht if dht is not None else Gc, dh0 if has_h0 else Gc, DHc, DVNc, cu,
                coff, seqs, HV=HV, K=K, V=V, BK=BK, BVF=BVF, BV=BV, HAS_DHT=dht is not None, HAS_H0=has_h0,
                NUM_STAGES=stages, PREC=prec, num_warps=CONFIG["bwd_state_warps"])
    _join(dev, forks)
    dq = torch.empty(B, T, HV, K, device=dev, dtype=f32 if HV != H else q.dtype)
    dk = torch.empty(B, T, HV, K, device=dev, dtype=f32 if HV != H else k.dtype)
    dv = torch.empty_like(v)
    dbeta = torch.empty(B, T, HV, device=dev, dtype=beta.dtype)
    dg = torch.empty(B, T, HV, K, device=dev, dtype=f32)
    Rs = torch.empty(NC, HV, BT, BT, device=dev, dtype=f32)
    Ps = torch.empty_like(Rs)
    DQs, DKs, DGs = (torch.empty(NC, HV, BT, BK, device=dev, dtype=f32) for _ in range(3))
    _bwd_prep[(NC, HV)](q, k, v, beta, do, Gc, Kkk, Mc, Hc, DHc, VNc, DVNc, dv, Rs, Ps, DQs, DKs, DGs, dbeta, cu, cidx,
                        scale, H, HV, K, V, BK=BK, KA=KA, BVF=BVF, BV=min(CONFIG["bwd_prep_bv"], BVF),
                        PREC=_prec(k.dtype, "bwd_prep"),
                        num_warps=CONFIG["bwd_prep_warps"], num_stages=CONFIG["bwd_prep_stages"])
    _bwd_intra[(NC, HV)](q, k, beta, Gc, Rs, Ps, DQs, DKs, DGs, dq, dk, dg, cu, cidx, scale, H, HV, K, BK=BK,
                         BKS=min(CONFIG["bwd_intra_bk"], BK), PREC=_prec(k.dtype, "bwd_intra"),
                         num_warps=CONFIG["bwd_intra_warps"],
                         num_stages=CONFIG["bwd_intra_stages"])
    if HV != H:  # grouped value heads: sum the group's contributions in a fixed order
        dq = dq.view(B, T, H, HV // H, K).sum(3).to(q.dtype)
        dk = dk.view(B, T, H, HV // H, K).sum(3).to(k.dtype)
    return dq, dk, dv, dg, dbeta, dh0


class _ChunkKDA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, h0, want_ht, gate, A_log, dt_bias, lower_bound, cu):
        plan = _chunk_plan(cu, q.shape[0], q.shape[1], q.device)
        o, ht, saved = _fwd(q, k, v, g, beta, scale, h0, want_ht, gate, A_log, dt_bias, lower_bound, plan, True)
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, *saved)
        ctx.plan, ctx.scale, ctx.gate, ctx.lower_bound, ctx.has_h0 = plan, scale, gate, lower_bound, h0 is not None
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, A_log, dt_bias, *saved = ctx.saved_tensors
        dq, dk, dv, dg, dbeta, dh0 = _bwd(q, k, v, beta, do.contiguous(), dht.contiguous() if dht is not None else None,
                                          ctx.has_h0, ctx.scale, saved, ctx.plan)
        dA_log = ddt = None
        if ctx.gate:  # the gate activation's own backward (elementwise; sums by torch's fixed-order reductions)
            with torch.enable_grad():
                inputs = [x.detach().requires_grad_(True) if x is not None else None for x in (g, A_log, dt_bias)]
                if ctx.gate == 1:
                    ga = naive_kda_gate(inputs[0], inputs[1], inputs[2])
                else:
                    ga = naive_kda_lowerbound_gate(inputs[0], inputs[1], inputs[2], ctx.lower_bound)
                live = [x for x in inputs if x is not None]
                grads = iter(torch.autograd.grad(ga, live, dg))
                dg, dA_log, ddt = (next(grads) if x is not None else None for x in inputs)
        return (dq, dk, dv, dg.to(g.dtype), dbeta, None, dh0, None, None, dA_log, ddt, None, None)


def _check(q, k, v, g, beta, initial_state, cu_seqlens, use_gate_in_kernel, A_log, dt_bias, lower_bound):
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must be [B, T, H, K] of one shape, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B, T, HV, V] with B={B}, T={T}, got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if HV % H:
        raise ValueError(f"v heads ({HV}) must be a multiple of q/k heads ({H})")
    if g.shape != (B, T, HV, K):
        raise ValueError(f"g must be [B, T, HV, K] = {(B, T, HV, K)}, got {tuple(g.shape)}")
    if beta.shape != (B, T, HV):
        raise ValueError(f"beta must be [B, T, HV] = {(B, T, HV)}, got {tuple(beta.shape)}")
    if not (1 <= K <= 256 and 1 <= V <= 256):
        raise ValueError(f"head dims must be in [1, 256], got K={K}, V={V}")
    if len({x.device for x in (q, k, v, g, beta)}) != 1:
        raise ValueError("q, k, v, g, beta must be on one device")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch size must be 1, got B={B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens must be a 1-D tensor [N+1]")
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is not None:
        if initial_state.shape != (N, HV, K, V) or initial_state.dtype != torch.float32:
            raise ValueError(f"initial_state must be fp32 [N, HV, K, V] = {(N, HV, K, V)}, "
                             f"got {initial_state.dtype} {tuple(initial_state.shape)}")
    if use_gate_in_kernel:
        if lower_bound is None and A_log is None:
            raise ValueError("A_log is required with use_gate_in_kernel=True unless lower_bound is set")
        if A_log is not None and A_log.numel() != HV:
            raise ValueError(f"A_log must have HV={HV} elements, got {A_log.numel()}")
        if dt_bias is not None and dt_bias.numel() != HV * K:
            raise ValueError(f"dt_bias must have HV*K={HV * K} elements, got {dt_bias.numel()}")


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              scale: float | None = None, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
              use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
              A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
              lower_bound: float | None = None, cu_seqlens: torch.Tensor | None = None,
              cu_seqlens_cpu: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA over whole sequences (prefill / training), differentiable. FLA's `chunk_kda` layouts:
    q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] (log-decay, or the raw gate input when
    `use_gate_in_kernel`: `-exp(A_log) softplus(g + dt_bias)`, or K3's safe gate
    `lower_bound * sigmoid(exp(A_log) (g + dt_bias))` when `lower_bound` is set); beta [B, T, HV];
    initial_state [N, HV, K, V] fp32; `cu_seqlens` int [N+1] packs N sequences into B = 1
    (`cu_seqlens_cpu`, a host copy, saves a device sync).
    Returns (o [B, T, HV, V] in v.dtype, final state [N, HV, K, V] fp32 or None)."""
    _check(q, k, v, g, beta, initial_state, cu_seqlens, use_gate_in_kernel, A_log, dt_bias, lower_bound)
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else float(scale)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    cu = None
    if cu_seqlens is not None:
        cu = tuple((cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist())
        if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must rise from 0 to {T}, got {cu}")
    gate = 0 if not use_gate_in_kernel else (2 if lower_bound is not None else 1)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    h0 = initial_state.contiguous() if initial_state is not None else None
    A_log = A_log.contiguous() if A_log is not None else None
    dt_bias = dt_bias.contiguous() if dt_bias is not None else None
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad
                                       for x in (q, k, v, g, beta, h0, A_log, dt_bias)):
        return _ChunkKDA.apply(q, k, v, g, beta, scale, h0, output_final_state, gate, A_log, dt_bias, lower_bound, cu)
    # inference: no autograd node, nothing saved (per-chunk states never reach memory)
    o, ht, _ = _fwd(q, k, v, g, beta, scale, h0, output_final_state, gate, A_log, dt_bias, lower_bound,
                    _chunk_plan(cu, B, T, q.device), False)
    return o, ht
