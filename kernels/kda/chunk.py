"""Chunked KDA in Triton: forward and backward (autograd), FLA-compatible `chunk_kda`.

Math (per head, chunk C = 64, G = in-chunk cumulative log-decay, q~ = scale * q), as in `naive_chunk_kda`:
  A[i,j]   = beta_i <k_i e^{G_i-G_j}, k_j>  (i > j),   M = (I + A)^-1
  W = M (beta k e^G),  U = M (beta v),  Aqk[i,j] = <q~_i e^{G_i-G_j}, k_j> (j <= i)
  v' = U - W S,  o = (q~ e^G) S + Aqk v',  S <- e^{G_C} S + (k e^{G_C-G})^T v'

Kernels (layout and staging ideas from fla-core 0.6.0 `fla/ops/kda/chunk_intra.py`, `fla/ops/common/chunk_delta_h.py`,
`fla/ops/kda/chunk_bwd.py`; written independently, no code copied). Forward:
  `_fwd_cumsum` (chunk, head, K slice): fused gate activation + in-chunk cumsum G.
  `_fwd_blocks` (chunk, head, 16x16 block): A and Aqk; off-diagonal blocks as two bounded exponentials
     around a reference row (tensor-core dots), diagonal blocks exactly as [i, j, K slice] tensors.
  `_fwd_solve` (chunk, head): M = (I + A)^-1 block row by block row, then W, U, q e^G, k e^{G_C-G}.
  `_fwd_state` (sequence, head, V block): the serial pass over chunks. The columns of the state evolve
     independently (v' = U - W S is column-wise), so splitting V gives B*HV*V/BV programs instead of B*HV;
     the output is fused into the pass, so in inference the per-chunk states never reach memory.
Backward: `_bwd_state` (reverse pass for dS and dv', same V split), `_bwd_prep` (chunk, head: dv, dAqk,
dA = -M^T dM M^T and the direct parts of dq, dk, dG, dbeta), `_bwd_blocks` (chunk, head, 16-row block x
K slice: the gated sub-block products' gradients), `_bwd_finish` (reverse in-chunk cumsum for dg, outputs).
Every reduction has a fixed order and there are no atomics: results are bitwise reproducible.
Intermediates live in a chunk-padded layout [chunks, HV, 64, D] so that later kernels need no row masks.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .naive import l2norm, naive_kda_gate, naive_kda_lowerbound_gate

BT = 64  # chunk size
BC = 16  # sub-block size inside a chunk

# launch settings (no autotuning, so the interpreter and the GPU run the same configs)
CONFIG = {"fwd_state_bv": 16, "fwd_state_warps": 4, "fwd_state_stages": 3,
          "bwd_state_bv": 16, "bwd_state_warps": 4, "bwd_state_stages": 3,
          "blocks_warps": 4, "blocks_stages": 1, "solve_warps": 4,
          "bwd_prep_bv": 32, "bwd_prep_warps": 4, "bwd_prep_stages": 1, "bwd_blocks_warps": 4,
          "kc": 16, "ka": 32}


@triton.jit
def _chunk_rows(cu, cidx, c):
    """(sequence, first token, valid rows from that token) of global chunk c."""
    n = tl.load(cidx + 2 * c).to(tl.int64)
    t0 = tl.load(cu + n).to(tl.int64) + tl.load(cidx + 2 * c + 1).to(tl.int64) * 64
    return n, t0, tl.load(cu + n + 1).to(tl.int64) - t0


@triton.jit
def _fwd_cumsum(g, A_log, dt_bias, Gc, cu, cidx, lower_bound, HV, K, BK: tl.constexpr, KA: tl.constexpr,
                GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr):
    """Gate activation (optional) and in-chunk cumulative sum of one K slice, fp32, chunk layout."""
    c = tl.program_id(0).to(tl.int64)
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
def _fwd_blocks(q, k, beta, Gc, Akk, Aqk, cu, cidx, scale, H, HV, K, BK: tl.constexpr, KC: tl.constexpr,
                PREC: tl.constexpr):
    """One 16 x 16 block (I, J) of A (with beta, strictly lower) and Aqk (lower; zeros above), over K slices.
    Off-diagonal: two bounded exponentials around the first row of block I; diagonal: exact, as [i, j, KC]."""
    c = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1).to(tl.int64)
    I = tl.program_id(2) // 4
    J = tl.program_id(2) % 4
    h = hv // (HV // H)
    _, t0, nv = _chunk_rows(cu, cidx, c)
    base = c * HV + hv
    pG = Gc + base * 64 * BK
    c16 = tl.arange(0, 16)
    rI = I * 16 + c16
    rJ = J * 16 + c16
    mI = rI < nv
    mJ = rJ < nv
    a_kk = tl.zeros([16, 16], dtype=tl.float32)
    a_qk = tl.zeros([16, 16], dtype=tl.float32)
    if I == J:
        for kc in tl.static_range(0, BK, KC):
            oc = kc + tl.arange(0, KC)
            mc = mI[:, None] & (oc < K)[None, :]
            kI = tl.load(k + ((t0 + rI) * H + h)[:, None] * K + oc[None, :], mask=mc, other=0.).to(tl.float32)
            qI = tl.load(q + ((t0 + rI) * H + h)[:, None] * K + oc[None, :], mask=mc, other=0.).to(tl.float32)
            GI = tl.load(pG + rI[:, None] * BK + oc[None, :])
            e3 = tl.exp(tl.where(c16[:, None, None] >= c16[None, :, None], GI[:, None, :] - GI[None, :, :],
                                 float("-inf")))
            kj3 = kI[None, :, :] * e3
            a_kk += tl.sum(kI[:, None, :] * kj3, 2)
            a_qk += tl.sum(qI[:, None, :] * kj3, 2)
        a_kk = tl.where(c16[:, None] > c16[None, :], a_kk, 0.)
    elif J < I:
        for kc in tl.static_range(0, BK, KC):
            oc = kc + tl.arange(0, KC)
            mc = oc < K
            kI = tl.load(k + ((t0 + rI) * H + h)[:, None] * K + oc[None, :], mask=mI[:, None] & mc[None, :],
                         other=0.).to(tl.float32)
            qI = tl.load(q + ((t0 + rI) * H + h)[:, None] * K + oc[None, :], mask=mI[:, None] & mc[None, :],
                         other=0.).to(tl.float32)
            kJ = tl.load(k + ((t0 + rJ) * H + h)[:, None] * K + oc[None, :], mask=mJ[:, None] & mc[None, :],
                         other=0.).to(tl.float32)
            GI = tl.load(pG + rI[:, None] * BK + oc[None, :])
            GJ = tl.load(pG + rJ[:, None] * BK + oc[None, :])
            gref = tl.load(pG + (I * 16) * BK + oc)
            eI = tl.exp(GI - gref[None, :])  # exponent <= 0
            kJe = kJ * tl.exp(gref[None, :] - GJ)  # exponent <= 0
            a_kk += tl.dot(kI * eI, tl.trans(kJe), input_precision=PREC)
            a_qk += tl.dot(qI * eI, tl.trans(kJe), input_precision=PREC)
    # blocks above the diagonal stay zero (Aqk is read whole; A's upper blocks are never read)
    bI = tl.load(beta + (t0 + rI) * HV + hv, mask=mI, other=0.).to(tl.float32)
    tl.store(Akk + base * 4096 + rI[:, None] * 64 + rJ[None, :], a_kk * bI[:, None])
    tl.store(Aqk + base * 4096 + rI[:, None] * 64 + rJ[None, :], (a_qk * scale).to(Aqk.dtype.element_ty))


@triton.jit
def _fwd_solve(q, k, v, beta, Gc, Akk, Mc, Wc, Uc, QGc, KDc, cu, cidx, scale, H, HV, K, V, BK: tl.constexpr,
               KA: tl.constexpr, BVF: tl.constexpr, PREC: tl.constexpr):
    """M = (I + A)^-1 block row by block row: M_I = D_I (E_I - sum_{J<I} A_IJ M_J),
    D_I = (I + A_II)^-1 = (I - A_II)(I + A_II^2)(I + A_II^4)(I + A_II^8); then W = M (beta k e^G),
    U = M (beta v), q e^G (scaled) and k e^{G_C - G}, by column slices."""
    c = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1).to(tl.int64)
    h = hv // (HV // H)
    _, t0, nv = _chunk_rows(cu, cidx, c)
    base = c * HV + hv
    r = tl.arange(0, 64)
    rm = r < nv
    c16 = tl.arange(0, 16)
    pA = Akk + base * 4096
    pM = Mc + base * 4096
    eye = tl.where(c16[:, None] == c16[None, :], 1., 0.)
    for I in tl.static_range(4):
        rI = I * 16 + c16
        X = -tl.load(pA + rI[:, None] * 64 + rI[None, :])
        D = eye + X
        for sq in tl.static_range(3):  # X^16 = 0 for a strictly lower 16 x 16
            X = tl.dot(X, X, input_precision=PREC)
            D = tl.dot(D, eye + X, input_precision=PREC)
        Y = tl.where(r[None, :] == rI[:, None], 1., 0.)
        for J in tl.static_range(I):
            rJ = J * 16 + c16
            Y -= tl.dot(tl.load(pA + rI[:, None] * 64 + rJ[None, :]), tl.load(pM + rJ[:, None] * 64 + r[None, :]),
                        input_precision=PREC)
        tl.store(pM + rI[:, None] * 64 + r[None, :], tl.dot(D, Y, input_precision=PREC))
        tl.debug_barrier()
    M = tl.load(pM + r[:, None] * 64 + r[None, :])
    bt = tl.load(beta + (t0 + r) * HV + hv, mask=rm, other=0.).to(tl.float32)
    pG = Gc + base * 64 * BK
    for kc in tl.static_range(0, BK, KA):
        oc = kc + tl.arange(0, KA)
        mrc = rm[:, None] & (oc < K)[None, :]
        G = tl.load(pG + r[:, None] * BK + oc[None, :])
        gC = tl.load(pG + 63 * BK + oc)
        kk = tl.load(k + ((t0 + r) * H + h)[:, None] * K + oc[None, :], mask=mrc, other=0.).to(tl.float32)
        qq = tl.load(q + ((t0 + r) * H + h)[:, None] * K + oc[None, :], mask=mrc, other=0.).to(tl.float32)
        eG = tl.exp(G)
        pK = base * 64 * BK + r[:, None] * BK + oc[None, :]
        tl.store(Wc + pK, tl.dot(M, kk * eG * bt[:, None], input_precision=PREC).to(Wc.dtype.element_ty))
        tl.store(KDc + pK, (kk * tl.exp(gC[None, :] - G)).to(KDc.dtype.element_ty))
        tl.store(QGc + pK, (qq * scale * eG).to(QGc.dtype.element_ty))
    for vc in tl.static_range(0, BVF, KA):
        ov = vc + tl.arange(0, KA)
        vv = tl.load(v + ((t0 + r) * HV + hv)[:, None] * V + ov[None, :], mask=rm[:, None] & (ov < V)[None, :],
                     other=0.).to(tl.float32)
        U = tl.dot(M, vv * bt[:, None], input_precision=PREC)
        tl.store(Uc + base * 64 * BVF + r[:, None] * BVF + ov[None, :], U.to(Uc.dtype.element_ty))


@triton.jit
def _fwd_state(Wc, Uc, QGc, KDc, Aqk, Gc, o, h0, ht, Hc, VNc, cu, coff,
               HV, K, V, BK: tl.constexpr, BVF: tl.constexpr,
               BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, SAVE: tl.constexpr,
               NUM_STAGES: tl.constexpr, PREC: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1).to(tl.int64)
    iv = tl.program_id(2)
    bos = tl.load(cu + n).to(tl.int64)
    eos = tl.load(cu + n + 1).to(tl.int64)
    c0 = tl.load(coff + n).to(tl.int64)
    nt = tl.load(coff + n + 1).to(tl.int64) - c0
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
def _bwd_state(QGc, Wc, KDc, Aqk, Gc, do, dht, dh0, DHc, DVNc, cu, coff,
               HV, K, V, BK: tl.constexpr, BVF: tl.constexpr,
               BV: tl.constexpr, HAS_DHT: tl.constexpr, HAS_H0: tl.constexpr, NUM_STAGES: tl.constexpr,
               PREC: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1).to(tl.int64)
    iv = tl.program_id(2)
    bos = tl.load(cu + n).to(tl.int64)
    eos = tl.load(cu + n + 1).to(tl.int64)
    c0 = tl.load(coff + n).to(tl.int64)
    nt = tl.load(coff + n + 1).to(tl.int64) - c0
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
def _bwd_prep(q, k, v, beta, do, Gc, Mc, Hc, DHc, VNc, DVNc, dv, Rs, Ps, DQs, DKs, DGs, DBs, cu, cidx, scale,
              H, HV, K, V, BK: tl.constexpr, KA: tl.constexpr, BVF: tl.constexpr, BV: tl.constexpr,
              PREC: tl.constexpr):
    """Full-chunk products: dv, R = dAqk, P = dA = -M^T dM M^T, and the direct parts of dq, dk, dG, dbeta."""
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
    # V only: products over V only (dAqk, dM's value part, dv, dbeta's value part)
    M = tl.load(Mc + base * 64 * 64 + r[:, None] * 64 + r[None, :])
    bt = tl.load(beta + (t0 + r) * HV + hv, mask=rm, other=0.).to(tl.float32)
    dAqk = tl.zeros([64, 64], dtype=tl.float32)
    dM = tl.zeros([64, 64], dtype=tl.float32)
    db = tl.zeros([64], dtype=tl.float32)
    for iv in range(BVF // BV):
        ov = iv * BV + tl.arange(0, BV)
        mrv = rm[:, None] & (ov < V)[None, :]
        pV = base * 64 * BVF + r[:, None] * BVF + ov[None, :]
        vn = tl.load(VNc + pV).to(tl.float32)
        dvn = tl.load(DVNc + pV).to(tl.float32)
        dO = tl.load(do + ((t0 + r) * HV + hv)[:, None] * V + ov[None, :], mask=mrv, other=0.).to(tl.float32)
        vv = tl.load(v + ((t0 + r) * HV + hv)[:, None] * V + ov[None, :], mask=mrv, other=0.).to(tl.float32)
        dAqk += tl.dot(dO, tl.trans(vn), input_precision=PREC)
        dM += tl.dot(dvn, tl.trans(vv * bt[:, None]), input_precision=PREC)
        dbv = tl.dot(tl.trans(M), dvn, input_precision=PREC)
        tl.store(dv + ((t0 + r) * HV + hv)[:, None] * V + ov[None, :], (dbv * bt[:, None]).to(dv.dtype.element_ty),
                 mask=mrv)
        db += tl.sum(vv * dbv, 1)
    tl.store(pR + r[:, None] * 64 + r[None, :], tl.where(r[:, None] >= r[None, :], dAqk, 0.))
    # per K slice, per K slice, products with the states (dqg = dO S^T, dW = -dv' S^T, dkd = v' dS^T)
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
            S = tl.load(Hc + pS).to(tl.float32)
            dS = tl.load(DHc + pS).to(tl.float32)
            vn = tl.load(VNc + pV).to(tl.float32)
            dvn = tl.load(DVNc + pV).to(tl.float32)
            dO = tl.load(do + ((t0 + r) * HV + hv)[:, None] * V + ov[None, :],
                         mask=rm[:, None] & (ov < V)[None, :], other=0.).to(tl.float32)
            dqg += tl.dot(dO, tl.trans(S), input_precision=PREC)
            dW -= tl.dot(dvn, tl.trans(S), input_precision=PREC)
            dkd += tl.dot(vn, tl.trans(dS), input_precision=PREC)
            dgc += tl.sum(S * dS, 1)
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
    tl.store(pP + r[:, None] * 64 + r[None, :], tl.where(r[:, None] > r[None, :], dA, 0.))
    tl.store(DBs + base * 64 + r, db)


@triton.jit
def _bwd_blocks(q, k, beta, Gc, Rs, Ps, DQs, DKs, DGs, DBp, cu, cidx, scale, H, HV, K, BK: tl.constexpr,
                KC: tl.constexpr, NKC: tl.constexpr, PREC: tl.constexpr):
    """Gradients through A (P = dA) and Aqk (R = dAqk) for one 16-row block b and one K slice (program axis 2):
    row side sum_j X_ij y_j e^{G_i-G_j}, column side sum_i X_ij x_i e^{G_i-G_j}, added to this block's rows."""
    c = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1).to(tl.int64)
    h = hv // (HV // H)
    _, t0, nv = _chunk_rows(cu, cidx, c)
    base = c * HV + hv
    c16 = tl.arange(0, 16)
    pG = Gc + base * 64 * BK
    pR = Rs + base * 64 * 64
    pP = Ps + base * 64 * 64
    b = tl.program_id(2) // NKC
    kc = (tl.program_id(2) % NKC) * KC
    i3 = c16[:, None, None]
    j3 = c16[None, :, None]
    rb = b * 16 + c16
    mb = rb < nv
    bb = tl.load(beta + (t0 + rb) * HV + hv, mask=mb, other=0.).to(tl.float32)
    Rbb = tl.load(pR + rb[:, None] * 64 + rb[None, :])
    Pbb = tl.load(pP + rb[:, None] * 64 + rb[None, :])
    dbb = tl.zeros([16], dtype=tl.float32)
    oc = kc + tl.arange(0, KC)
    mbk = mb[:, None] & (oc < K)[None, :]
    qb = tl.load(q + ((t0 + rb) * H + h)[:, None] * K + oc[None, :], mask=mbk, other=0.).to(tl.float32)
    qb = qb * scale
    kb = tl.load(k + ((t0 + rb) * H + h)[:, None] * K + oc[None, :], mask=mbk, other=0.).to(tl.float32)
    Gb = tl.load(pG + rb[:, None] * BK + oc[None, :])
    refb = tl.load(pG + (b * 16) * BK + oc)
    eb = tl.exp(Gb - refb[None, :])
    kbe = kb * eb
    rowR = tl.zeros([16, KC], dtype=tl.float32)
    rowP = tl.zeros([16, KC], dtype=tl.float32)
    colX = tl.zeros([16, KC], dtype=tl.float32)
    # unrolled over every other block with the inactive ones zeroed (no branches: all loads can be issued early)
    for J in tl.static_range(3):  # rows b, columns J < b
        live = J < b
        rJ = J * 16 + c16
        kJ = tl.load(k + ((t0 + rJ) * H + h)[:, None] * K + oc[None, :],
                     mask=(rJ < nv)[:, None] & (oc < K)[None, :], other=0.).to(tl.float32)
        GJ = tl.load(pG + rJ[:, None] * BK + oc[None, :])
        kJe = kJ * tl.exp(tl.where(live, refb[None, :] - GJ, 0.))
        RbJ = tl.where(live, tl.load(pR + rb[:, None] * 64 + rJ[None, :]), 0.)
        PbJ = tl.where(live, tl.load(pP + rb[:, None] * 64 + rJ[None, :]), 0.)
        rowR += tl.dot(RbJ, kJe, input_precision=PREC)
        rowP += tl.dot(PbJ, kJe, input_precision=PREC)
        dbb += tl.sum(PbJ * tl.dot(kbe, tl.trans(kJe), input_precision=PREC), 1)
    rowR *= eb
    rowP *= eb
    for I in tl.static_range(1, 4):  # rows I > b, columns b
        live = I > b
        rI = I * 16 + c16
        mIk = (rI < nv)[:, None] & (oc < K)[None, :]
        qI = tl.load(q + ((t0 + rI) * H + h)[:, None] * K + oc[None, :], mask=mIk, other=0.).to(tl.float32)
        kI = tl.load(k + ((t0 + rI) * H + h)[:, None] * K + oc[None, :], mask=mIk, other=0.).to(tl.float32)
        GI = tl.load(pG + rI[:, None] * BK + oc[None, :])
        bI = tl.load(beta + (t0 + rI) * HV + hv, mask=rI < nv, other=0.).to(tl.float32)
        refI = tl.load(pG + (I * 16) * BK + oc)
        eI = tl.exp(GI - refI[None, :])
        RIb = tl.where(live, tl.load(pR + rI[:, None] * 64 + rb[None, :]), 0.)
        PIb = tl.where(live, tl.load(pP + rI[:, None] * 64 + rb[None, :]) * bI[:, None], 0.)
        part = tl.dot(tl.trans(RIb), qI * scale * eI, input_precision=PREC) + \
            tl.dot(tl.trans(PIb), kI * eI, input_precision=PREC)
        colX += tl.exp(tl.where(live, refI[None, :] - Gb, 0.)) * part
    # diagonal block, exact: e3[i, j, :] = e^{G_i - G_j} for i >= j
    e3 = tl.exp(tl.where(i3 >= j3, Gb[:, None, :] - Gb[None, :, :], float("-inf")))
    kj3 = kb[None, :, :] * e3
    rowR += tl.sum(Rbb[:, :, None] * kj3, 1)
    rowP += tl.sum(Pbb[:, :, None] * kj3, 1)
    dbb += tl.sum(Pbb * tl.sum(kb[:, None, :] * kj3, 2), 1)
    rowP *= bb[:, None]
    colX += tl.sum((Rbb[:, :, None] * qb[:, None, :] + (Pbb * bb[:, None])[:, :, None] * kb[:, None, :]) * e3,
                   0)
    pb = base * 64 * BK + rb[:, None] * BK + oc[None, :]
    tl.store(DQs + pb, tl.load(DQs + pb) + rowR)
    tl.store(DKs + pb, tl.load(DKs + pb) + rowP + colX)
    tl.store(DGs + pb, tl.load(DGs + pb) + qb * rowR + kb * (rowP - colX))
    tl.store(DBp + (base * NKC + tl.program_id(2) % NKC) * 64 + rb, dbb)


@triton.jit
def _bwd_finish(DQs, DKs, DGs, DBs, DBp, dq, dk, dg, dbeta, cu, cidx, scale, HV, K, BK: tl.constexpr,
                KA: tl.constexpr, NKC: tl.constexpr):
    """Reverse in-chunk cumsum for dg; dq, dk, dg, dbeta written in the caller's layouts."""
    c = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1).to(tl.int64)
    _, t0, nv = _chunk_rows(cu, cidx, c)
    base = c * HV + hv
    r = tl.arange(0, 64)
    rm = r < nv
    for kc in tl.static_range(0, BK, KA):
        oc = kc + tl.arange(0, KA)
        mrc = rm[:, None] & (oc < K)[None, :]
        pK = base * 64 * BK + r[:, None] * BK + oc[None, :]
        po = ((t0 + r) * HV + hv)[:, None] * K + oc[None, :]
        tl.store(dg + po, tl.cumsum(tl.load(DGs + pK), 0, reverse=True).to(dg.dtype.element_ty), mask=mrc)
        tl.store(dq + po, (tl.load(DQs + pK) * scale).to(dq.dtype.element_ty), mask=mrc)
        tl.store(dk + po, tl.load(DKs + pK).to(dk.dtype.element_ty), mask=mrc)
    db = tl.load(DBs + base * 64 + r)
    for i in tl.static_range(NKC):  # fixed order
        db += tl.load(DBp + (base * NKC + i) * 64 + r)
    tl.store(dbeta + (t0 + r) * HV + hv, db.to(dbeta.dtype.element_ty), mask=rm)


def _p2(x: int) -> int:
    return max(16, triton.next_power_of_2(x))


def _prec(dtype: torch.dtype) -> str:
    """fp32 dot precision: near-fp32 (3xTF32) for fp32 inputs, TF32 when the inputs are 16-bit anyway."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


_PLANS: dict = {}


def _chunk_plan(cu: list[int] | None, B: int, T: int, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cu_seqlens int64 [N+1], chunk -> (sequence, chunk in sequence) int32 [NC, 2], chunk offsets int32 [N+1]).
    Fixed-length batches are built on the device and cached (no host sync); packed ones from the host list."""
    if cu is None:
        key = (B, T, str(device))
        if key not in _PLANS:
            nt = triton.cdiv(T, BT)
            c = torch.arange(B * nt, device=device, dtype=torch.int32)
            _PLANS[key] = (torch.arange(B + 1, device=device, dtype=torch.int64) * T,
                           torch.stack([c // nt, c % nt], 1).contiguous(),
                           torch.arange(B + 1, device=device, dtype=torch.int32) * nt)
        return _PLANS[key]
    pairs, offs = [], [0]
    for i in range(len(cu) - 1):
        nt = triton.cdiv(cu[i + 1] - cu[i], BT)
        pairs.extend((i, t) for t in range(nt))
        offs.append(offs[-1] + nt)
    cidx = torch.tensor(pairs, dtype=torch.int32).view(-1, 2)
    return tuple(x.to(device, non_blocking=True) for x in (torch.tensor(cu, dtype=torch.int64), cidx,
                                                           torch.tensor(offs, dtype=torch.int32)))


def _fwd(q, k, v, g, beta, scale, h0, want_ht, gate, A_log, dt_bias, lower_bound, plan, save):
    cu, cidx, coff = plan
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    N, NC = coff.numel() - 1, cidx.shape[0]
    BK, BVF = _p2(K), _p2(V)
    KC, KA = min(CONFIG["kc"], BK), min(CONFIG["ka"], BK, BVF)
    dev, dt, f32, prec = q.device, k.dtype, torch.float32, _prec(k.dtype)
    Gc = torch.empty(NC, HV, BT, BK, device=dev, dtype=f32)
    Akk = torch.empty(NC, HV, BT, BT, device=dev, dtype=f32)
    Mc = torch.empty(NC, HV, BT, BT, device=dev, dtype=f32)
    Aqk = torch.empty(NC, HV, BT, BT, device=dev, dtype=dt)
    Wc, QGc, KDc = (torch.empty(NC, HV, BT, BK, device=dev, dtype=dt) for _ in range(3))
    Uc = torch.empty(NC, HV, BT, BVF, device=dev, dtype=dt)
    dummy = Gc
    _fwd_cumsum[(NC, HV, BK // KA)](g, A_log if A_log is not None else dummy, dt_bias if dt_bias is not None else dummy,
                                    Gc, cu, cidx, float(lower_bound) if lower_bound is not None else 0., HV, K, BK=BK,
                                    KA=KA, GATE=gate, HAS_A=A_log is not None, HAS_DT=dt_bias is not None, num_warps=4)
    _fwd_blocks[(NC, HV, 16)](q, k, beta, Gc, Akk, Aqk, cu, cidx, scale, H, HV, K, BK=BK, KC=KC, PREC=prec,
                              num_warps=CONFIG["blocks_warps"], num_stages=CONFIG["blocks_stages"])
    _fwd_solve[(NC, HV)](q, k, v, beta, Gc, Akk, Mc, Wc, Uc, QGc, KDc, cu, cidx, scale, H, HV, K, V, BK=BK, KA=KA,
                         BVF=BVF, PREC=prec, num_warps=CONFIG["solve_warps"], num_stages=1)
    o = torch.empty_like(v)
    ht = torch.empty(N, HV, K, V, device=dev, dtype=f32) if want_ht else None
    Hc = torch.empty(NC, HV, BK, BVF, device=dev, dtype=dt) if save else None
    VNc = torch.empty(NC, HV, BT, BVF, device=dev, dtype=dt) if save else None
    BV = min(CONFIG["fwd_state_bv"], BVF)
    _fwd_state[(N, HV, triton.cdiv(V, BV))](
        Wc, Uc, QGc, KDc, Aqk, Gc, o, h0 if h0 is not None else dummy, ht if ht is not None else dummy,
        Hc if save else dummy, VNc if save else dummy, cu, coff, HV=HV, K=K, V=V, BK=BK, BVF=BVF, BV=BV,
        HAS_H0=h0 is not None, STORE_HT=want_ht, SAVE=save, NUM_STAGES=CONFIG["fwd_state_stages"], PREC=prec,
        num_warps=CONFIG["fwd_state_warps"])
    return o, ht, (Gc, Mc, Aqk, Wc, QGc, KDc, Hc, VNc)


def _bwd(q, k, v, beta, do, dht, has_h0, scale, saved, plan):
    cu, cidx, coff = plan
    Gc, Mc, Aqk, Wc, QGc, KDc, Hc, VNc = saved
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N, NC = coff.numel() - 1, cidx.shape[0]
    BK, BVF = _p2(K), _p2(V)
    KC, KA = min(CONFIG["kc"], BK), min(CONFIG["ka"], BK)
    NKC = BK // KC
    dev, dt, f32, prec = q.device, k.dtype, torch.float32, _prec(k.dtype)
    DHc = torch.empty(NC, HV, BK, BVF, device=dev, dtype=dt)
    DVNc = torch.empty(NC, HV, BT, BVF, device=dev, dtype=dt)
    dh0 = torch.empty(N, HV, K, V, device=dev, dtype=f32) if has_h0 else None
    BV = min(CONFIG["bwd_state_bv"], BVF)
    _bwd_state[(N, HV, triton.cdiv(V, BV))](
        QGc, Wc, KDc, Aqk, Gc, do, dht if dht is not None else Gc, dh0 if has_h0 else Gc, DHc, DVNc, cu, coff,
        HV=HV, K=K, V=V, BK=BK, BVF=BVF, BV=BV, HAS_DHT=dht is not None, HAS_H0=has_h0,
        NUM_STAGES=CONFIG["bwd_state_stages"], PREC=prec, num_warps=CONFIG["bwd_state_warps"])
    dq = torch.empty(B, T, HV, K, device=dev, dtype=f32 if HV != H else q.dtype)
    dk = torch.empty(B, T, HV, K, device=dev, dtype=f32 if HV != H else k.dtype)
    dv = torch.empty_like(v)
    dbeta = torch.empty(B, T, HV, device=dev, dtype=beta.dtype)
    dg = torch.empty(B, T, HV, K, device=dev, dtype=f32)
    Rs = torch.empty(NC, HV, BT, BT, device=dev, dtype=f32)
    Ps = torch.empty_like(Rs)
    DQs, DKs, DGs = (torch.empty(NC, HV, BT, BK, device=dev, dtype=f32) for _ in range(3))
    DBs = torch.empty(NC, HV, BT, device=dev, dtype=f32)
    DBp = torch.empty(NC, HV, NKC, BT, device=dev, dtype=f32)
    _bwd_prep[(NC, HV)](q, k, v, beta, do, Gc, Mc, Hc, DHc, VNc, DVNc, dv, Rs, Ps, DQs, DKs, DGs, DBs, cu, cidx,
                        scale, H, HV, K, V, BK=BK, KA=KA, BVF=BVF, BV=min(CONFIG["bwd_prep_bv"], BVF), PREC=prec,
                        num_warps=CONFIG["bwd_prep_warps"], num_stages=CONFIG["bwd_prep_stages"])
    _bwd_blocks[(NC, HV, 4 * NKC)](q, k, beta, Gc, Rs, Ps, DQs, DKs, DGs, DBp, cu, cidx, scale, H, HV, K, BK=BK,
                                   KC=KC, NKC=NKC, PREC=prec, num_warps=CONFIG["bwd_blocks_warps"], num_stages=1)
    _bwd_finish[(NC, HV)](DQs, DKs, DGs, DBs, DBp, dq, dk, dg, dbeta, cu, cidx, scale, HV, K, BK=BK, KA=KA, NKC=NKC,
                          num_warps=4)
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
        cu = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
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
