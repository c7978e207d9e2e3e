"""Chunked KDA backward: the reverse state pass (dS, dv'), the per-chunk prep (dv, dbeta, dAqk, dA and the
direct parts of dq, dk, dG), the intra kernel (chunk_bwd_intra.py); `_bwd` launches them."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunk_bwd_intra import _bwd_intra
from .plan import (BT, CONFIG, _forked, _join, _prec, _record, _state_split, _wait, segment_bounds, state_grid,
                   state_stages, tile_dims)
from .utils import _chunk_rows, _state_program


@triton.jit
def _bwd_state(QGc, Wc, KDc, Aqk, Gc, do, dht, dh0, DHc, DVNc, cu, coff, seqs, t_lo, t_hi, dht_row, dh0_row,
               HV, K, V, BK: tl.constexpr, BVF: tl.constexpr,
               BV: tl.constexpr, HAS_DHT: tl.constexpr, HAS_H0: tl.constexpr, NUM_STAGES: tl.constexpr,
               PREC: tl.constexpr):
    """The reverse pass over chunks t_hi - 1 .. t_lo of each sequence (a time segment, `plan.segment_bounds`; the
    whole sequence: its chunk count .. 0): dS starts from row dht_row of dht and ends in row dh0_row of dh0 (-1:
    the sequence's own row)."""
    n, hv, iv = _state_program(seqs, V, BV)
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
        dS += tl.load(dht + ((tl.where(dht_row < 0, n, dht_row) * HV + hv) * K + ok[:, None]) * V + ov[None, :],
                      mask=km[:, None] & vm[None, :], other=0.)
    t_end = tl.minimum(nt, t_hi)
    for i in tl.range(0, t_end - t_lo, num_stages=NUM_STAGES):
        t = t_end - 1 - i
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
        tl.store(dh0 + ((tl.where(dh0_row < 0, n, dh0_row) * HV + hv) * K + ok[:, None]) * V + ov[None, :], dS,
                 mask=km[:, None] & vm[None, :])


@triton.jit
def _bwd_prep(q, k, v, beta, do, Gc, gated_kk, Mc, Hc, DHc, VNc, DVNc, dv, Rs, Ps, DQs, DKs, DGs, dbeta, cu, cidx,
              c_first, scale, H, HV, K, V, BK: tl.constexpr, KA: tl.constexpr, BVF: tl.constexpr, BV: tl.constexpr,
              PREC: tl.constexpr):
    """Full-chunk products of chunk c_first + program: dv, dbeta, R = dAqk, P = dA = -M^T dM M^T, and the direct
    parts of dq, dk, dG."""
    c = tl.program_id(0).to(tl.int64) + c_first
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
    db += tl.sum(dA * tl.load(gated_kk + base * 4096 + r[:, None] * 64 + r[None, :]), 1)  # A = beta_i gated_kk
    tl.store(dbeta + (t0 + r) * HV + hv, db.to(dbeta.dtype.element_ty), mask=rm)


def _bwd(q, k, v, beta, do, dht, has_h0, scale, saved, plan):
    cu, cidx, coff, classes = plan
    Gc, gated_kk, Mc, Aqk, Wc, QGc, KDc, Hc, VNc = saved
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N, NC = coff.numel(), cidx.shape[0]
    BK, BVF = tile_dims(K, V, k.dtype, q.device)
    KA = min(CONFIG["ka"], BK)
    dev, dt, f32, prec = q.device, k.dtype, torch.float32, _prec(k.dtype)
    alloc = torch.empty if V == BVF else torch.zeros  # as in `_fwd`: the prep reads V columns no block wrote
    DHc = alloc(NC, HV, BK, BVF, device=dev, dtype=dt)
    DVNc = alloc(NC, HV, BT, BVF, device=dev, dtype=dt)
    dh0 = torch.empty(N, HV, K, V, device=dev, dtype=f32) if has_h0 else None
    dq = torch.empty(B, T, HV, K, device=dev, dtype=f32 if HV != H else q.dtype)
    dk = torch.empty(B, T, HV, K, device=dev, dtype=f32 if HV != H else k.dtype)
    dv = torch.empty_like(v)
    dbeta = torch.empty(B, T, HV, device=dev, dtype=beta.dtype)
    dg = torch.empty(B, T, HV, K, device=dev, dtype=f32)
    Rs = torch.empty(NC, HV, BT, BT, device=dev, dtype=f32)
    Ps = torch.empty_like(Rs)
    DQs, DKs, DGs = (torch.empty(NC, HV, BT, BK, device=dev, dtype=f32) for _ in range(3))

    def state_pass(cls, lo, hi, dht_in, dh0_out, BV, stages, carried_in, carried_out):
        _bwd_state[state_grid(cls.count, HV, V, BV)](
            QGc, Wc, KDc, Aqk, Gc, do, dht_in if dht_in is not None else Gc, dh0_out if dh0_out is not None else Gc,
            DHc, DVNc, cu, coff, cls.seqs, lo, hi, 0 if carried_in else -1, 0 if carried_out else -1, HV=HV, K=K,
            V=V, BK=BK, BVF=BVF, BV=BV, HAS_DHT=dht_in is not None, HAS_H0=dh0_out is not None, NUM_STAGES=stages,
            PREC=prec, num_warps=CONFIG["bwd_state_warps"])

    def chunk_work(c_first, chunks):
        _bwd_prep[(chunks, HV)](q, k, v, beta, do, Gc, gated_kk, Mc, Hc, DHc, VNc, DVNc, dv, Rs, Ps, DQs, DKs, DGs,
                                dbeta, cu, cidx, c_first, scale, H, HV, K, V, BK=BK, KA=KA, BVF=BVF,
                                BV=min(CONFIG["bwd_prep_bv"], BVF), PREC=_prec(k.dtype, "bwd_prep"),
                                num_warps=CONFIG["bwd_prep_warps"], num_stages=CONFIG["bwd_prep_stages"])
        _bwd_intra[(chunks, HV)](q, k, beta, Gc, Rs, Ps, DQs, DKs, DGs, dq, dk, dg, cu, cidx, c_first, scale, H, HV,
                                 K, BK=BK, BKS=min(CONFIG["bwd_intra_bk"], BK), PREC=_prec(k.dtype, "bwd_intra"),
                                 num_warps=CONFIG["bwd_intra_warps"], num_stages=CONFIG["bwd_intra_stages"])

    segments = segment_bounds(classes[0], CONFIG["bwd_segments"], CONFIG["bwd_segment_chunks"]) \
        if len(classes) == 1 else []
    if len(segments) > 1:  # one sequence, cut in time: segment s's chunk work beside segment s - 1's reverse pass
        cls = classes[0]
        BV, stages = _state_split("bwd", HV, K, V, BK, BVF, k.element_size(), dev)
        BV = min(CONFIG["bwd_state_segmented_bv"] or BV, BVF)
        stages = state_stages(CONFIG["bwd_state_segmented_stages"] or stages, BK, BV, k.element_size())
        carries = [torch.empty(1, HV, K, V, device=dev, dtype=f32) for _ in segments[1:]]  # dS between segments
        order = list(reversed(range(len(segments))))
        done = []
        with _forked(True, dev, 0):  # all passes queued on the side stream at once (a later fork would wait for
            for s in order:          # the chunk work queued meanwhile), an event after each
                first, last = s == 0, s == len(segments) - 1
                state_pass(cls, *segments[s], dht if last else carries[s], dh0 if first else carries[s - 1], BV,
                           stages, not last, not first)
                done.append(_record(dev))
        for s, event in zip(order, done):
            _wait(dev, event)
            chunk_work(cls.first_chunk + segments[s][0], segments[s][1] - segments[s][0])
        _join(dev, [0])
    else:
        forks = len(classes) - 1 if dev.type == "cuda" else 0  # all classes' passes at once, the longest first
        for i, cls in enumerate(classes):
            BV, stages = _state_split("bwd", cls.count * HV, K, V, BK, BVF, k.element_size(), dev)
            with _forked(i < forks, dev, i):
                state_pass(cls, 0, cls.chunks, dht, dh0, BV, stages, False, False)
        _join(dev, range(forks))
        chunk_work(0, NC)
    if HV != H:  # grouped value heads: sum the group's contributions in a fixed order
        dq = dq.view(B, T, H, HV // H, K).sum(3).to(q.dtype)
        dk = dk.view(B, T, H, HV // H, K).sum(3).to(k.dtype)
    return dq, dk, dv, dg, dbeta, dh0
