"""Chunked KDA forward: gate + in-chunk cumsum, the intra kernels (chunk_intra.py), the serial state pass with
the output fused in; `_fwd` launches them class by class (plan.py)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunk_intra import _fwd_intra
from .gate import GATE_NONE, gate_activation
from .plan import (BT, CONFIG, _forked, _join, _prec, _state_split, forward_segments, state_grid, state_stages,
                   tile_dims)
from .utils import _chunk_rows, _state_program


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
    if GATE != GATE_NONE:
        if HAS_DT:
            gx = gx + tl.load(dt_bias + hv * K + oc, mask=oc < K, other=0.).to(tl.float32)[None, :]
        a_exp = 1.
        if HAS_A:
            a_exp = tl.exp(tl.load(A_log + hv).to(tl.float32))
        gx = gate_activation(gx, a_exp, lower_bound, GATE, HAS_A)
    gx = tl.where(m, gx, 0.)
    tl.store(Gc + (c * HV + hv) * 64 * BK + r[:, None] * BK + oc[None, :], tl.cumsum(gx, 0))


@triton.jit
def _fwd_state(Wc, Uc, QGc, KDc, Aqk, Gc, o, h0, ht, Hc, VNc, cu, coff, seqs, t_lo, t_hi, h0_row, ht_row,
               HV, K, V, BK: tl.constexpr, BVF: tl.constexpr,
               BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, SAVE: tl.constexpr,
               NUM_STAGES: tl.constexpr, PREC: tl.constexpr):
    """The serial pass over chunks t_lo .. t_hi - 1 of each sequence (a time segment, `plan.segment_bounds`; the
    whole sequence: 0 .. its chunk count): the state starts from row h0_row of h0 and ends in row ht_row of ht
    (-1: the sequence's own row)."""
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
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + ((tl.where(h0_row < 0, n, h0_row) * HV + hv) * K + ok[:, None]) * V + ov[None, :],
                     mask=km[:, None] & vm[None, :], other=0.)
    for t in tl.range(t_lo, tl.minimum(nt, t_hi), num_stages=NUM_STAGES):
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
        tl.store(ht + ((tl.where(ht_row < 0, n, ht_row) * HV + hv) * K + ok[:, None]) * V + ov[None, :], S,
                 mask=km[:, None] & vm[None, :])


def _fwd_chunks(q, k, v, g, beta, A_log, dt_bias, lower_bound, gate, scale, Gc, Aqk, gated_kk, Mc, Wc, Uc, QGc, KDc,
                cu, cidx, c_first, chunks, save, BK, BVF, KA, prec):
    """The chunk work of chunks c_first .. c_first + chunks - 1: gate + cumsum, then the two intra launches."""
    H, K, HV, V = q.shape[2], q.shape[3], v.shape[2], v.shape[3]
    dev = q.device
    _fwd_cumsum[(chunks, HV, BK // KA)](
        g, A_log if A_log is not None else Gc, dt_bias if dt_bias is not None else Gc, Gc, cu, cidx, c_first,
        float(lower_bound) if lower_bound is not None else 0., HV, K, BK=BK, KA=KA, GATE=gate,
        HAS_A=A_log is not None, HAS_DT=dt_bias is not None, num_warps=4)
    for whole in (True, False):  # each chunk's program works in one of the two launches
        launch = "intra_whole" if whole else "intra"
        cap = CONFIG[f"{launch}_maxnreg"] if dev.type == "cuda" else None  # register cap (None: none)
        _fwd_intra[(chunks, HV)](
            q, k, v, beta, Gc, Aqk, gated_kk if save else Gc, Mc if save else Gc, Wc, Uc, QGc, KDc, cu, cidx, c_first,
            scale, H, HV, K, V, BK=BK, BKS=min(CONFIG["intra_bk"], BK), BVS=min(CONFIG["intra_bk"], BVF), BVF=BVF,
            SAVE=save, WHOLE=whole, PREC=prec, FAST=dev.type == "cuda", num_warps=CONFIG[f"{launch}_warps"],
            num_stages=CONFIG[f"{launch}_stages"], **({"maxnreg": cap} if cap else {}))


def _fwd(q, k, v, g, beta, scale, h0, want_ht, gate, A_log, dt_bias, lower_bound, plan, save):
    cu, cidx, coff, classes = plan
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    N, NC = coff.numel(), cidx.shape[0]
    BK, BVF = tile_dims(K, V, k.dtype, q.device)
    KA = min(CONFIG["ka"], BK, BVF)
    dev, dt, f32, prec = q.device, k.dtype, torch.float32, _prec(k.dtype)
    Gc = torch.empty(NC, HV, BT, BK, device=dev, dtype=f32)
    # the gated key-key products <k_i e^{G_i - G_j}, k_j> before beta (A = beta_i gated_kk), for dbeta
    gated_kk = torch.empty(NC, HV, BT, BT, device=dev, dtype=f32) if save else None
    Mc = torch.empty(NC, HV, BT, BT, device=dev, dtype=f32) if save else None
    Aqk = torch.empty(NC, HV, BT, BT, device=dev, dtype=dt)
    Wc, QGc, KDc = (torch.empty(NC, HV, BT, BK, device=dev, dtype=dt) for _ in range(3))
    Uc = torch.empty(NC, HV, BT, BVF, device=dev, dtype=dt)
    o = torch.empty_like(v)
    ht = torch.empty(N, HV, K, V, device=dev, dtype=f32) if want_ht else None
    # the state pass writes the V columns its blocks cover (cdiv(V, BV) * BV), the backward prep reads all BVF: a
    # padded V gets zeros in the rest
    alloc = torch.empty if V == BVF else torch.zeros
    Hc = alloc(NC, HV, BK, BVF, device=dev, dtype=dt) if save else None
    VNc = alloc(NC, HV, BT, BVF, device=dev, dtype=dt) if save else None
    forks = len(classes) - 1 if dev.type == "cuda" else 0  # every class's pass but the last one's is forked
    side = []  # the side streams used
    for i, cls in enumerate(classes):
        segments = forward_segments(cls, HV)
        BV, stages = _state_split("fwd", cls.count * HV, K, V, BK, BVF, k.element_size(), dev)
        which = "segmented" if len(segments) > 1 else "forked" if i < forks else "rest" if forks else None
        if which:
            BV = min(CONFIG[f"fwd_state_{which}_bv"] or BV, BVF)
            stages = state_stages(CONFIG[f"fwd_state_{which}_stages"] or stages, BK, BV, k.element_size())
        # a segmented class's state leaves one segment's pass for the next one's in carries[s] (fp32: exact)
        carries = [torch.empty(1, HV, K, V, device=dev, dtype=f32) for _ in segments[1:]]
        for s, (lo, hi) in enumerate(segments):
            first, last = s == 0, s == len(segments) - 1
            if hi > lo:  # (a class of empty sequences only has no chunk work, just its state pass: h0 -> ht)
                _fwd_chunks(q, k, v, g, beta, A_log, dt_bias, lower_bound, gate, scale, Gc, Aqk, gated_kk, Mc, Wc,
                            Uc, QGc, KDc, cu, cidx, cls.first_chunk + lo, hi - lo, save, BK, BVF, KA, prec)
            fork = dev.type == "cuda" and (i < forks or len(segments) > 1)
            if fork and i not in side:
                side.append(i)
            h0_in = h0 if first else carries[s - 1]
            ht_out = (ht if want_ht else None) if last else carries[s]
            with _forked(fork, dev, i):
                _fwd_state[state_grid(cls.count, HV, V, BV)](
                    Wc, Uc, QGc, KDc, Aqk, Gc, o, h0_in if h0_in is not None else Gc,
                    ht_out if ht_out is not None else Gc, Hc if save else Gc, VNc if save else Gc, cu, coff,
                    cls.seqs, lo, hi, -1 if first else 0, -1 if last else 0, HV=HV, K=K, V=V, BK=BK, BVF=BVF,
                    BV=BV, HAS_H0=h0_in is not None, STORE_HT=ht_out is not None, SAVE=save, NUM_STAGES=stages,
                    PREC=prec, num_warps=CONFIG["fwd_state_warps"])
    _join(dev, side)
    return o, ht, (Gc, gated_kk, Mc, Aqk, Wc, QGc, KDc, Hc, VNc)
