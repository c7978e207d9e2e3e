"""Forward intra-chunk kernel: A = beta <k_i e^{G_i-G_j}, k_j>, Aqk, M = (I + A)^-1, W, U, q e^G, k e^{G_C-G}
(64-row tensor-core dots; see chunk.py for the design)."""
from __future__ import annotations

import triton
import triton.language as tl

from .utils import LOG2E, _chunk_tile, _exp2, _intra_program, _whole_chunk


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
def _intra_chunk(v, beta, pG, Aqk, gated_kk, Mc, Wc, Uc, QGc, KDc, scale, hv, t0, nv, base, qh, kh, H, HV, K, V,
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
        tl.store(gated_kk + pA, akk)
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
def _fwd_intra(q, k, v, beta, Gc, Aqk, gated_kk, Mc, Wc, Uc, QGc, KDc, cu, cidx, c_first, scale, H, HV, K, V,
               BK: tl.constexpr, BKS: tl.constexpr, BVF: tl.constexpr, BVS: tl.constexpr, SAVE: tl.constexpr,
               WHOLE: tl.constexpr, PREC: tl.constexpr, FAST: tl.constexpr):
    """Everything inside one chunk of one head with 64-row tensor-core dots: A and Aqk, M = (I + A)^-1, then
    W = M (beta k e^G), U = M (beta v), q e^G (scaled), k e^{G_C - G}. A launch does the chunks whose channels
    each span at most 80 of log-decay (`_whole_products`) when WHOLE, the others (`_block_products`) when not:
    the host launches both, each compiled for its path alone, and a program of the other kind returns at once
    (one kernel with both paths spills and ran slower; the whole-chunk launch's register cap is
    `intra_whole_maxnreg`: kernels/kda/NOTES.md)."""
    hv, t0, nv, base, pG, qh, kh = _intra_program(q, k, Gc, cu, cidx, c_first, H, HV, K, BK)
    if _whole_chunk(pG, BK) == WHOLE:
        _intra_chunk(v, beta, pG, Aqk, gated_kk, Mc, Wc, Uc, QGc, KDc, scale, hv, t0, nv, base, qh, kh, H, HV, K, V, BK,
                     BKS, BVF, BVS, SAVE, WHOLE, PREC, FAST)
