"""Grouped GEMMs over expert-sorted rows (Triton): the experts' gate/up projection with SiTU-and-mul (and FP8
quantisation of H) fused into its epilogue, the down projection, their dgrads (SiTU's backward fused into the down
dgrad's epilogue) and the weight gradients.

Every program owns one tile of one expert's rows (the tile table of `RoutingPlan.tiles`) and reduces over K in a
fixed order with one fixed configuration per kernel (no autotuning by row count): a row's result depends only on
its own inputs and its expert's weights, not on the batch it came in, and is the same on every run. The weight
gradient kernel gives each (expert, tile of the weight) to one program, which walks the expert's rows in order:
no atomics, no split reduction. FP8 (e4m3): activations carry 1 x 128 scales along K, weights 128 x 128 block
scales; each K step's fp32 partial product is scaled before it is accumulated (DeepSeek-V3's recipe).
Spec: naive.py (naive_experts, naive_experts_fp8).
"""
from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from k3_kernels.launch import cdiv
from k3_kernels.moe import gluon_bf16, gluon_gate_up, gluon_gemm
from k3_kernels.moe.permute import (QUANT_BLOCK, RoutingPlan, program_tile, row_pass_grid, row_pass_program,
                                    store_row_quant)
from k3_kernels.situ.fused import situ_grads, situ_h


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8


class GemmKernels(enum.Enum):
    """Which kernels run the grouped GEMMs on CUDA: TRITON (this file and fp8_grad.py: the CPU-tested path) or
    GLUON (gluon_gemm.py, gluon_bf16.py: warp-specialised, sm_90 only, written to give the Triton kernels' bits)."""
    TRITON = "triton"
    GLUON = "gluon"


# The kernels used outside any `gemm_kernels` block (where GLUON can run; TRITON elsewhere). GLUON: on the H200 every
# grouped GEMM gave the Triton kernels' bits and ran as fast or faster (kernels/moe/NOTES.md, session 31), except
# the bf16 wgrad, which the default keeps on Triton (`wgrad`).
DEFAULT_GEMM_KERNELS = GemmKernels.GLUON

_GEMM_KERNELS_OVERRIDE: list[GemmKernels] = []


@contextlib.contextmanager
def gemm_kernels(impl: GemmKernels):
    """Run the grouped GEMMs with `impl` inside the block, where it can run (benchmarks and tests compare them)."""
    if not isinstance(impl, GemmKernels):
        raise ValueError(f"impl: expected a GemmKernels, got {impl!r}")
    _GEMM_KERNELS_OVERRIDE.append(impl)
    try:
        yield
    finally:
        _GEMM_KERNELS_OVERRIDE.pop()


def gemm_kernels_override() -> GemmKernels | None:
    """The innermost `gemm_kernels` block's choice (None outside any): the layer's backward runs under the
    forward's."""
    return _GEMM_KERNELS_OVERRIDE[-1] if _GEMM_KERNELS_OVERRIDE else None


def gemm_kernels_for(device: torch.device, k: int, n: int, dtype: torch.dtype = torch.float8_e4m3fn) -> GemmKernels:
    """The chosen kernels (override, else DEFAULT_GEMM_KERNELS) where GLUON can run -- an sm_90 GPU, e4m3 or bf16
    operands and whole tiles along K and N (gluon_gemm.usable / gluon_bf16.usable); TRITON otherwise (CPU: the
    interpreter)."""
    want = _GEMM_KERNELS_OVERRIDE[-1] if _GEMM_KERNELS_OVERRIDE else DEFAULT_GEMM_KERNELS
    if want is GemmKernels.TRITON or device.type != "cuda" or _interpreting():
        return GemmKernels.TRITON
    usable = {torch.float8_e4m3fn: gluon_gemm.usable, torch.bfloat16: gluon_bf16.usable}.get(dtype)
    if usable is None:
        return GemmKernels.TRITON
    if not usable(k, n) or torch.cuda.get_device_capability(device) != (9, 0):
        return GemmKernels.TRITON
    return GemmKernels.GLUON


def _interpreting() -> bool:
    import os
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def configs(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict[str, TileConfig]:
    """One fixed configuration per kernel (batch invariance: never chosen by the row count). The H200 tiles are
    the best of a per-kernel sweep (benchmarks/moe.py --sweep 112,16384; NOTES.md); fp32 operands (the model's
    fp32 tests) take small tiles that fit shared memory."""
    if device.type != "cuda":  # interpreter: small tiles
        t = TileConfig(16, 32, 32, 4, 1, 2)
        return {"gate_up": TileConfig(16, 128, 32, 4, 1, 2), "mm": t, "wgrad": TileConfig(32, 32, 16, 4, 1)}
    fp8 = {"gate_up_fp8": TileConfig(64, 128, 128, 4, 3), "mm_fp8": TileConfig(128, 128, 128, 8, 3)}  # e4m3 operands
    if dtype == torch.float32:
        return {"gate_up": TileConfig(64, 64, 32, 4, 2), "mm": TileConfig(64, 64, 32, 4, 2),
                "wgrad": TileConfig(32, 64, 32, 4, 2), **fp8}
    return {"gate_up": TileConfig(128, 128, 64, 8, 3), "mm": TileConfig(128, 256, 64, 8, 3),
            "wgrad": TileConfig(64, 128, 128, 8, 3), **fp8}


@triton.jit
def _gate_up_kernel(x_ptr, xs_ptr, w1_ptr, w3_ptr, ws1_ptr, ws3_ptr, gu_ptr, h_ptr, hq_ptr, hs_ptr, tiles_ptr,
                    n_tiles_m, I, K, beta, linear_beta,
                    FP8: tl.constexpr, ACT_BF16: tl.constexpr, SAVE_GU: tl.constexpr, WRITE_H: tl.constexpr,
                    QUANT_H: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    QB: tl.constexpr, PREC: tl.constexpr):
    """G = X W1_e^T, U = X W3_e^T (fp32 acc, rounded to the activation dtype), H = SiTU(G) * cap(U)."""
    e, r0, r1, tn = program_tile(tl.program_id(0), tiles_ptr, n_tiles_m, tl.cdiv(I, BLOCK_N), GROUP_M)
    if e >= 0:
        e64 = e.to(tl.int64)
        rows = r0 + tl.arange(0, BLOCK_M)
        rmask = rows < r1
        r64 = rows.to(tl.int64)
        cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < I
        kk = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + r64[:, None] * K + kk[None, :]
        b_off = e64 * I * K + cols[None, :].to(tl.int64) * K + kk[:, None]
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            km = (k0 + kk) < K
            a = tl.load(a_ptrs + k0, mask=rmask[:, None] & km[None, :], other=0.0)
            b1 = tl.load(w1_ptr + b_off + k0, mask=km[:, None] & cmask[None, :], other=0.0)
            b3 = tl.load(w3_ptr + b_off + k0, mask=km[:, None] & cmask[None, :], other=0.0)
            if FP8:
                kb = k0 // QB
                nkb = K // QB
                sa = tl.load(xs_ptr + r64 * nkb + kb, mask=rmask, other=0.0)
                sw = (e64 * tl.cdiv(I, QB) + cols // QB) * nkb + kb
                s1 = tl.load(ws1_ptr + sw, mask=cmask, other=0.0)
                s3 = tl.load(ws3_ptr + sw, mask=cmask, other=0.0)
                acc_g += tl.dot(a, b1) * (sa[:, None] * s1[None, :])
                acc_u += tl.dot(a, b3) * (sa[:, None] * s3[None, :])
            else:
                acc_g = tl.dot(a, b1, acc_g, input_precision=PREC)
                acc_u = tl.dot(a, b3, acc_u, input_precision=PREC)
        m = rmask[:, None] & cmask[None, :]
        if ACT_BF16:  # G, U rounded to the activation dtype once (what is saved is what SiTU reads)
            g = acc_g.to(tl.bfloat16)
            u = acc_u.to(tl.bfloat16)
        else:
            g = acc_g
            u = acc_u
        if SAVE_GU:
            gp = gu_ptr + r64[:, None] * (2 * I) + cols[None, :]
            tl.store(gp, g.to(gu_ptr.dtype.element_ty), mask=m)
            tl.store(gp + I, u.to(gu_ptr.dtype.element_ty), mask=m)
        gf = g.to(tl.float32)
        uf = u.to(tl.float32)
        h = situ_h(gf, uf, beta, linear_beta)
        if WRITE_H:
            tl.store(h_ptr + r64[:, None] * I + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=m)
        if QUANT_H:  # BLOCK_N == QB: one scale per row of the tile
            store_row_quant(h, m, rmask, r64, cols, tn, hq_ptr, I, hs_ptr, tl.cdiv(I, QB))


@triton.jit
def _segment_mm_kernel(a_ptr, as_ptr, b0_ptr, b1_ptr, bs_ptr, c_ptr, gu_ptr, tiles_ptr, n_tiles_m, N, K0, a_stride,
                       b_se, b_sn, b_sk, c_stride, beta, linear_beta,
                       TWO_B: tl.constexpr, FP8: tl.constexpr, SITU_BWD: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       QB: tl.constexpr, PREC: tl.constexpr):
    """C = A B_e^T over the tile's rows; B_e[n, k] at b + e b_se + n b_sn + k b_sk. TWO_B: A has 2 K0 columns,
    the first K0 against b0, the rest against b1. SITU_BWD: C is dH; writes dG, dU into c ([P, 2N]) from the saved
    G, U (gu [P, 2N])."""
    e, r0, r1, tn = program_tile(tl.program_id(0), tiles_ptr, n_tiles_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if e >= 0:
        e64 = e.to(tl.int64)
        rows = r0 + tl.arange(0, BLOCK_M)
        rmask = rows < r1
        r64 = rows.to(tl.int64)
        cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        kk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        b_base = e64 * b_se + cols[None, :].to(tl.int64) * b_sn + kk[:, None].to(tl.int64) * b_sk
        for k0 in range(0, K0, BLOCK_K):
            km = (k0 + kk) < K0
            a = tl.load(a_ptr + r64[:, None] * a_stride + k0 + kk[None, :], mask=rmask[:, None] & km[None, :],
                        other=0.0)
            b = tl.load(b0_ptr + b_base + k0 * b_sk, mask=km[:, None] & cmask[None, :], other=0.0)
            if FP8:
                kb = k0 // QB
                nkb = K0 // QB
                sa = tl.load(as_ptr + r64 * nkb + kb, mask=rmask, other=0.0)
                sb = tl.load(bs_ptr + (e64 * tl.cdiv(N, QB) + cols // QB) * nkb + kb, mask=cmask, other=0.0)
                acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
            else:
                acc = tl.dot(a, b, acc, input_precision=PREC)
        if TWO_B:
            for k0 in range(0, K0, BLOCK_K):
                km = (k0 + kk) < K0
                a = tl.load(a_ptr + r64[:, None] * a_stride + K0 + k0 + kk[None, :],
                            mask=rmask[:, None] & km[None, :], other=0.0)
                b = tl.load(b1_ptr + b_base + k0 * b_sk, mask=km[:, None] & cmask[None, :], other=0.0)
                acc = tl.dot(a, b, acc, input_precision=PREC)
        m = rmask[:, None] & cmask[None, :]
        if SITU_BWD:
            gp = gu_ptr + r64[:, None] * (2 * N) + cols[None, :]
            g = tl.load(gp, mask=m, other=0.0).to(tl.float32)
            u = tl.load(gp + N, mask=m, other=0.0).to(tl.float32)
            dh = acc.to(c_ptr.dtype.element_ty).to(tl.float32)  # dH rounded as an unfused dgrad would store it
            dg, du = situ_grads(dh, g, u, beta, linear_beta)
            cp = c_ptr + r64[:, None] * (2 * N) + cols[None, :]
            tl.store(cp, dg.to(c_ptr.dtype.element_ty), mask=m)
            tl.store(cp + N, du.to(c_ptr.dtype.element_ty), mask=m)
        else:
            tl.store(c_ptr + r64[:, None] * c_stride + cols[None, :], acc.to(c_ptr.dtype.element_ty), mask=m)


@triton.jit
def _wgrad_kernel(d_ptr, x_ptr, out_ptr, offsets_ptr, Nd, Kd, d_stride, x_stride,
                  BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr):
    """out[e] = D_e^T X_e over expert e's rows, walked in order by one program per (expert, out tile)."""
    e = tl.program_id(1).to(tl.int64)
    n_tn = tl.cdiv(Nd, BLOCK_N)
    tn = tl.program_id(0) % n_tn
    tk = tl.program_id(0) // n_tn
    r0 = tl.load(offsets_ptr + e)
    r1 = tl.load(offsets_ptr + e + 1)
    ns = tn * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tk * BLOCK_K + tl.arange(0, BLOCK_K)
    nm = ns < Nd
    kmask = ks < Kd
    rr = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for p0 in range(r0, r1, BLOCK_R):
        p = p0 + rr
        pm = p < r1
        p64 = p.to(tl.int64)
        dt = tl.load(d_ptr + p64[None, :] * d_stride + ns[:, None], mask=nm[:, None] & pm[None, :], other=0.0)
        xt = tl.load(x_ptr + p64[:, None] * x_stride + ks[None, :], mask=pm[:, None] & kmask[None, :], other=0.0)
        acc = tl.dot(dt, xt, acc, input_precision=PREC)
    tl.store(out_ptr + e * Nd * Kd + ns[:, None].to(tl.int64) * Kd + ks[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=nm[:, None] & kmask[None, :])


# ------------------------------------------------------------------------------------------------- host wrappers
def _prec(dtype: torch.dtype) -> str:
    """fp32 operands multiply to fp32 accuracy (as the torch path does), not in plain TF32: three TF32 products on
    the GPU's tensor cores, exact fp32 in the interpreter; bf16 operands as they are."""
    if dtype != torch.float32:
        return "tf32"
    return "ieee" if _interpreting() else "tf32x3"


def _grid(plan: RoutingPlan, cfg: TileConfig, n: int) -> tuple[torch.Tensor, int, tuple[int]]:
    tiles = plan.tiles(cfg.block_m)
    return tiles, tiles.shape[0], (tiles.shape[0] * cdiv(n, cfg.block_n),)


def gate_up(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, plan: RoutingPlan, beta: float, linear_beta: float,
            *, save_gu: bool, write_h: bool = True, act_dtype: torch.dtype | None = None, quant_h: bool = False,
            fp8: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
            = None) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Expert-sorted rows x [P, L] (bf16; or with fp8 = (xq, xs, w1q, w1s, w3q, w3s) only its shape is read) ->
    (gu [P, 2I] | None, h [P, I] | None, hq fp8 [P, I] | None, hs [P, I / 128] | None); gu, h in act_dtype
    (default x's)."""
    P, K = x.shape
    I = w1.shape[1]
    if (act_dtype or x.dtype) not in (torch.bfloat16, torch.float32):
        raise ValueError(f"x: activations must be bf16 or fp32, got {act_dtype or x.dtype}")
    cfg = configs(x.device, act_dtype or x.dtype)["gate_up_fp8" if fp8 is not None and x.is_cuda else "gate_up"]
    if quant_h and (I % QUANT_BLOCK or cfg.block_n != QUANT_BLOCK):
        raise ValueError(f"w1: FP8 H needs an intermediate size divisible by {QUANT_BLOCK}, got {I}")
    dev, dt = x.device, act_dtype or x.dtype
    gu = torch.empty(P, 2 * I, device=dev, dtype=dt) if save_gu else None
    h = torch.empty(P, I, device=dev, dtype=dt) if write_h else None
    hq = torch.empty(P, I, device=dev, dtype=torch.float8_e4m3fn) if quant_h else None
    hs = torch.empty(P, I // QUANT_BLOCK, device=dev, dtype=torch.float32) if quant_h else None
    if P == 0:
        return gu, h, hq, hs
    if (gemm_kernels_for(x.device, K, I) if fp8 is not None else
            dt == x.dtype and gemm_kernels_for(x.device, K, I, x.dtype)) is GemmKernels.GLUON:
        return _gate_up_gluon(x, w1, w3, plan, beta, linear_beta, gu, h, hq, hs, dt, fp8)
    tiles, n_m, grid = _grid(plan, cfg, I)
    any_out = next(t for t in (gu, h, hq) if t is not None)
    if fp8 is not None:
        xq, xs, w1q, w1s, w3q, w3s = fp8
        a, a_s, b1, b3, s1, s3 = xq, xs, w1q, w3q, w1s, w3s
    else:
        a, a_s, b1, b3, s1, s3 = x, x, w1, w3, w1, w3
    _gate_up_kernel[grid](
        a, a_s, b1, b3, s1, s3, gu if save_gu else any_out, h if write_h else any_out, hq if quant_h else any_out,
        hs if quant_h else any_out, tiles, n_m, I, K, float(beta), float(linear_beta), FP8=fp8 is not None,
        ACT_BF16=dt == torch.bfloat16,
        SAVE_GU=save_gu, WRITE_H=write_h, QUANT_H=quant_h, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, QB=QUANT_BLOCK, PREC=_prec(dt),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return gu, h, hq, hs


# the forward SiTU quantiser's program size (rows x warps; any gives the same bits: benchmarks/moe.py
# --pass-settings R/RW/C/CW/S/SW sweeps it)
SITU_QUANT_ROWS, SITU_QUANT_WARPS = 16, 4


@triton.jit
def _situ_quant_kernel(gu_ptr, h_ptr, hq_ptr, hs_ptr, P, I, beta, linear_beta, WRITE_H: tl.constexpr,
                       QUANT_H: tl.constexpr, BLOCK_M: tl.constexpr, QB: tl.constexpr):
    """H = SiTU(G) * cap(U) from the stored G | U [P, 2I], and H's FP8 rows (1 x QB blocks): the gate/up kernel's
    epilogue as a pass of its own (the Gluon GEMM writes G | U), the same arithmetic, so the same bits."""
    row_block, cb = row_pass_program(tl.program_id(0), tl.cdiv(I, QB))
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = cb * QB + tl.arange(0, QB)
    rmask = rows < P
    m = rmask[:, None] & (cols < I)[None, :]
    r64 = rows.to(tl.int64)
    gp = gu_ptr + r64[:, None] * (2 * I) + cols[None, :]
    gf = tl.load(gp, mask=m, other=0.0).to(tl.float32)
    uf = tl.load(gp + I, mask=m, other=0.0).to(tl.float32)
    h = situ_h(gf, uf, beta, linear_beta)
    if WRITE_H:
        tl.store(h_ptr + r64[:, None] * I + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=m)
    if QUANT_H:
        store_row_quant(h, m, rmask, r64, cols, cb, hq_ptr, I, hs_ptr, tl.cdiv(I, QB))


def situ_quant(gu: torch.Tensor, beta: float, linear_beta: float, h: torch.Tensor | None, hq: torch.Tensor | None,
               hs: torch.Tensor | None) -> None:
    """Fill h [P, I] (if given) and hq / hs (if given: FP8 rows of H and their 1 x 128 scales) from gu [P, 2I]."""
    P, I2 = gu.shape
    I = I2 // 2
    if P == 0 or (h is None and hq is None):
        return
    if hq is not None and I % QUANT_BLOCK:
        raise ValueError(f"gu: FP8 H needs an intermediate size divisible by {QUANT_BLOCK}, got {I}")
    BM = SITU_QUANT_ROWS
    any_out = h if h is not None else hq
    _situ_quant_kernel[row_pass_grid(P, BM, cdiv(I, QUANT_BLOCK))](
        gu, any_out if h is None else h, any_out if hq is None else hq, any_out if hs is None else hs, P, I,
        float(beta), float(linear_beta), WRITE_H=h is not None, QUANT_H=hq is not None, BLOCK_M=BM,
        QB=QUANT_BLOCK, num_warps=SITU_QUANT_WARPS)


def _gate_up_gluon(x, w1, w3, plan: RoutingPlan, beta: float, linear_beta: float, gu, h, hq, hs, dt, fp8=None):
    """The gate/up on a Gluon GEMM (FP8 with fp8 = (xq, xs, w1q, w1s, w3q, w3s), else bf16): G | U in one launch
    (W1's columns then W3's), then H (and its FP8 rows) by `situ_quant`; or (FP8, `GluonTile.fuse_situ`) all in
    one launch (gluon_gate_up.py)."""
    tile = gluon_gemm.DEFAULT_TILE
    if fp8 is not None and tile.fuse_situ:
        xq, xs, w1q, w1s, w3q, w3s = fp8
        gluon_gate_up.scaled_gate_up(xq, xs, (w1q, w1s), (w3q, w3s), plan.tiles(tile.block_m), beta, linear_beta,
                                     gu, h, hq, hs, dt, tile=tile)
        return gu, h, hq, hs
    P, I = x.shape[0], w1.shape[1]
    out = gu if gu is not None else torch.empty(P, 2 * I, device=x.device, dtype=dt)
    if fp8 is not None:
        xq, xs, w1q, w1s, w3q, w3s = fp8
        gluon_gemm.scaled_segment_mm(xq, xs, w1q, w1s, plan.tiles(tile.block_m), out, b2=(w3q, w3s), tile=tile)
    else:
        _segment_mm_gluon_bf16(x, w1, plan, out, gluon_bf16.BLayout.K_CONTIGUOUS, b2=w3)
    situ_quant(out, beta, linear_beta, h, hq, hs)
    return gu, h, hq, hs


def _segment_mm_gluon_bf16(a, b, plan: RoutingPlan, out, layout: "gluon_bf16.BLayout", b2=None):
    tile = gluon_bf16.DEFAULT_TILE
    return gluon_bf16.segment_mm(a, b, plan.tiles(tile.block_m), out, layout, b2=b2, tile=tile)


def down(h: torch.Tensor, w2: torch.Tensor, plan: RoutingPlan, out_dtype: torch.dtype,
         fp8: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Y = H W2_e^T per expert: h [P, I] (or fp8 = (hq, hs, w2q, w2s)), w2 [E, L, I] -> [P, L]."""
    if fp8 is not None:
        hq, hs, w2q, w2s = fp8
        return scaled_mm((hq, hs), (w2q, w2s), plan, out_dtype)
    P, I = h.shape
    L = w2.shape[1]
    y = torch.empty(P, L, device=h.device, dtype=out_dtype)
    if P == 0:
        return y
    if h.dtype == out_dtype and gemm_kernels_for(h.device, I, L, h.dtype) is GemmKernels.GLUON:
        return _segment_mm_gluon_bf16(h, w2, plan, y, gluon_bf16.BLayout.K_CONTIGUOUS)
    cfg = configs(h.device, out_dtype)["mm"]
    tiles, n_m, grid = _grid(plan, cfg, L)
    _segment_mm_kernel[grid](h, h, w2, w2, w2, y, y, tiles, n_m, L, I, h.stride(0), L * I, I, 1, L, 0.0, 0.0,
                             TWO_B=False, FP8=False, SITU_BWD=False, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                             BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, QB=QUANT_BLOCK, PREC=_prec(out_dtype),
                             num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


def scaled_mm(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor], plan: RoutingPlan,
              out_dtype: torch.dtype) -> torch.Tensor:
    """C = A B_e^T per expert, block-scaled FP8: a = (rows e4m3 [P, K], scales [P, K / 128]), b = (e4m3 [E, N, K],
    scales [E, N / 128, K / 128]) -> [P, N]. The down projection and the FP8 dgrads (fp8_grad.py, on the
    weights' transposed copies)."""
    (aq, a_s), (bq, b_s) = a, b
    P, K = aq.shape
    E, N, _ = bq.shape
    c = torch.empty(P, N, device=aq.device, dtype=out_dtype)
    if P == 0:
        return c
    if gemm_kernels_for(aq.device, K, N) is GemmKernels.GLUON:
        tile = gluon_gemm.DEFAULT_TILE
        return gluon_gemm.scaled_segment_mm(aq, a_s, bq, b_s, plan.tiles(tile.block_m), c, tile=tile)
    cfg = configs(aq.device, out_dtype)["mm_fp8" if aq.is_cuda else "mm"]
    tiles, n_m, grid = _grid(plan, cfg, N)
    _segment_mm_kernel[grid](aq, a_s, bq, bq, b_s, c, c, tiles, n_m, N, K, aq.stride(0), N * K, K, 1, N, 0.0, 0.0,
                             TWO_B=False, FP8=True, SITU_BWD=False, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                             BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, QB=QUANT_BLOCK, PREC="tf32",
                             num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return c


@triton.jit
def _situ_bwd_kernel(dh_ptr, gu_ptr, dgu_ptr, P, I, beta, linear_beta, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr):
    """dG | dU [P, 2I] from dH [P, I] and the saved G | U [P, 2I] (SiTU's backward, fp32 math)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    m = (rows < P)[:, None] & (cols < I)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    dh = tl.load(dh_ptr + r64 * I + cols[None, :], mask=m, other=0.0).to(tl.float32)
    g = tl.load(gu_ptr + r64 * (2 * I) + cols[None, :], mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + r64 * (2 * I) + I + cols[None, :], mask=m, other=0.0).to(tl.float32)
    dg, du = situ_grads(dh, g, u, beta, linear_beta)
    out = dgu_ptr + r64 * (2 * I) + cols[None, :]
    tl.store(out, dg.to(dgu_ptr.dtype.element_ty), mask=m)
    tl.store(out + I, du.to(dgu_ptr.dtype.element_ty), mask=m)


def down_dgrad_situ(dy: torch.Tensor, w2: torch.Tensor, gu: torch.Tensor, plan: RoutingPlan, beta: float,
                    linear_beta: float, fused: bool = False) -> torch.Tensor:
    """dH = dY W2_e, then SiTU's backward -> dGU [P, 2I] (dG | dU) from the saved gu [P, 2I]. `fused` does the
    SiTU backward in the GEMM's epilogue instead; that GEMM ran well below the plain one on the H200
    (kernels/moe/NOTES.md), so the default stores dH (bf16, as an unfused dgrad would) and runs an elementwise
    pass; both give the same bits."""
    P, L = dy.shape
    I = w2.shape[2]
    dgu = torch.empty(P, 2 * I, device=dy.device, dtype=gu.dtype)
    if P == 0:
        return dgu
    if not fused and dy.dtype == gu.dtype and gemm_kernels_for(dy.device, L, I, dy.dtype) is GemmKernels.GLUON:
        dh = _segment_mm_gluon_bf16(dy, w2, plan, torch.empty(P, I, device=dy.device, dtype=gu.dtype),
                                    gluon_bf16.BLayout.N_CONTIGUOUS)
        return situ_backward(dh, gu, beta, linear_beta, dgu)
    cfg = configs(dy.device, dy.dtype)["mm"]
    tiles, n_m, grid = _grid(plan, cfg, I)
    dh = dgu if fused else torch.empty(P, I, device=dy.device, dtype=gu.dtype)
    # B_e[n = i, k = l] = W2[e, l, i]
    _segment_mm_kernel[grid](dy, dy, w2, w2, w2, dh, gu, tiles, n_m, I, L, dy.stride(0), L * I, 1, I, I,
                             float(beta), float(linear_beta), TWO_B=False, FP8=False, SITU_BWD=fused,
                             BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                             QB=QUANT_BLOCK, PREC=_prec(dy.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if not fused:
        situ_backward(dh, gu, beta, linear_beta, dgu)
    return dgu


def situ_backward(dh: torch.Tensor, gu: torch.Tensor, beta: float, linear_beta: float,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """dG | dU [P, 2I] (gu's dtype) from dH [P, I] and the saved G | U [P, 2I]: SiTU-and-mul's backward."""
    P, I = dh.shape
    dgu = out if out is not None else torch.empty(P, 2 * I, device=dh.device, dtype=gu.dtype)
    if P:
        BM, BI = 4, 512
        _situ_bwd_kernel[(cdiv(P, BM), cdiv(I, BI))](dh, gu, dgu, P, I, float(beta), float(linear_beta),
                                                     BLOCK_M=BM, BLOCK_I=BI, num_warps=4)
    return dgu


def gate_up_dgrad(dgu: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """dX = dG W1_e + dU W3_e: dgu [P, 2I], w1/w3 [E, I, L] -> [P, L] (one accumulator over both halves)."""
    P = dgu.shape[0]
    _, I, L = w1.shape
    dx = torch.empty(P, L, device=dgu.device, dtype=dgu.dtype)
    if P == 0:
        return dx
    if gemm_kernels_for(dgu.device, 2 * I, L, dgu.dtype) is GemmKernels.GLUON:
        return _segment_mm_gluon_bf16(dgu, w1, plan, dx, gluon_bf16.BLayout.N_CONTIGUOUS, b2=w3)
    cfg = configs(dgu.device, dgu.dtype)["mm"]
    tiles, n_m, grid = _grid(plan, cfg, L)
    # B_e[n = l, k = i] = W1[e, i, l]
    _segment_mm_kernel[grid](dgu, dgu, w1, w3, w1, dx, dx, tiles, n_m, L, I, dgu.stride(0), I * L, 1, L, L,
                             0.0, 0.0, TWO_B=True, FP8=False, SITU_BWD=False, BLOCK_M=cfg.block_m,
                             BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, QB=QUANT_BLOCK,
                             PREC=_prec(dgu.dtype),
                             num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return dx


def wgrad(d: torch.Tensor, x: torch.Tensor, plan: RoutingPlan, out_dtype: torch.dtype) -> torch.Tensor:
    """Per-expert weight gradient out[e] = D_e^T X_e: d [P, Nd] (a strided column slice is fine), x [P, Kd] ->
    [E, Nd, Kd]; experts without rows get zeros."""
    Nd, Kd = d.shape[1], x.shape[1]
    E = plan.n_experts
    out = torch.empty(E, Nd, Kd, device=x.device, dtype=out_dtype)
    if d.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError("d, x: the last dimension must be contiguous")
    tile = gluon_bf16.DEFAULT_TILE  # (its K, the expert's rows, is any length: only the output tiles must be whole)
    # Gluon only when asked for by name: at 896 experts and 4K tokens the all-Gluon bf16 layer's forward+backward
    # ran slower than Triton's, its forward no slower; this kernel (TMA descriptors made on the device by every
    # program) is the suspect, not yet isolated (kernels/moe/NOTES.md)
    if (d.dtype == x.dtype == out_dtype and Nd % tile.block_m == 0 and gemm_kernels_override() is GemmKernels.GLUON
            and gemm_kernels_for(x.device, tile.block_k, Kd, x.dtype) is GemmKernels.GLUON):
        return gluon_bf16.wgrad(d, x, plan.offsets, E, out_dtype, tile=tile)
    cfg = configs(x.device, x.dtype)["wgrad"]
    grid = (cdiv(Nd, cfg.block_n) * cdiv(Kd, cfg.block_k), E)
    _wgrad_kernel[grid](d, x, out, plan.offsets, Nd, Kd, d.stride(0), x.stride(0), BLOCK_R=cfg.block_m,
                        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PREC=_prec(x.dtype), num_warps=cfg.num_warps,
                        num_stages=cfg.num_stages)
    return out
