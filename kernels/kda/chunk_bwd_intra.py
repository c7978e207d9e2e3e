"""Backward intra-chunk kernel: the gradients through the gated products of A (P = dA) and Aqk (R = dAqk),
the reverse in-chunk cumsum for dg (whole-chunk dots or 16 x 16 blocks)."""
from __future__ import annotations

import triton
import triton.language as tl

from .utils import _chunk_tile, _intra_program, _tile, _whole_chunk


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
def _bwd_intra(q, k, beta, Gc, Rs, Ps, DQs, DKs, DGs, dq, dk, dg, cu, cidx, c_first, scale, H, HV, K,
               BK: tl.constexpr, BKS: tl.constexpr, PREC: tl.constexpr):
    """Gradients through A (P = dA) and Aqk (R = dAqk) for one chunk (c_first + program) of one head, one K slice
    at a time, added to the direct parts from `_bwd_prep`; writes dq, dk, dg (reverse in-chunk cumsum). A chunk
    whose log-decay spans at most 80 in every channel (the span's test is the chunk's own data: batch invariant)
    takes 64-row dots (`_bwd_whole`), any other the 16-row blocks (`_bwd_blocks`)."""
    hv, t0, nv, base, pG, qh, kh = _intra_program(q, k, Gc, cu, cidx, c_first, H, HV, K, BK)
    if _whole_chunk(pG, BK):
        _bwd_whole(beta, Rs, Ps, DQs, DKs, DGs, dq, dk, dg, scale, HV, K, hv, t0, nv, base, pG, qh, kh, H, BK, BKS,
                   PREC)
    else:
        _bwd_blocks(beta, Rs, Ps, DQs, DKs, DGs, dq, dk, dg, scale, HV, K, hv, t0, nv, base, pG, qh, kh, H, BK, BKS,
                    PREC)
