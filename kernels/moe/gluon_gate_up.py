"""The FP8 gate/up GEMM with SiTU-and-mul and H's FP8 rows in its epilogue, for Hopper in Gluon.

A tile is 128 rows x 128 intermediate columns of both G = X W1_e^T and U = X W3_e^T: gluon_gemm's 256-column tile
whose two halves come from the two weights (`_load_blocks` with SPLIT_B), so each consumer warpgroup ends a tile
holding G and U of the same columns and writes G | U (when saved for the backward), H (when wanted) and H's 1 x 128
FP8 rows straight from its registers. The arithmetic is that of grouped_gemm's Triton gate/up epilogue and of
`grouped_gemm.situ_quant` (the pass after gluon_gemm's unfused G | U launch): G and U rounded to the activation
dtype, H = `situ_h` of those in fp32, its rows quantised by `store_row_quant` -- so the same bits, without that
pass's second read of G | U. sm_90 only (`tests/kernels/test_moe_gluon.py` compares it with the Triton gate/up on
the GPU and checks its sm_90a build on CPU); `GluonTile.fuse_situ` chooses it.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from k3_kernels.moe.gluon_gemm import (_GL_DTYPES, _MAXNREG, _SCALE_N, DEFAULT_TILE, QUANT_BLOCK, GluonTile,
                                       _consume_wide_tile, _descriptor, _mm_producer, _mm_tile, _programs, _ring_of)
from k3_kernels.moe.permute import store_row_quant
from k3_kernels.situ.fused import situ_h


@gluon.jit
def _gate_up_consumer(a_bufs, b_bufs, ready, empty, as_ptr, bs_ptr, bs2_ptr, gu_ptr, h_ptr, hq_ptr, hs_ptr,
                      tiles_ptr, n_tiles_m, I, K, beta, linear_beta, ROW_OFFSET: gl.constexpr,
                      HALF_M: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                      ACT_DTYPE: gl.constexpr, SAVE_GU: gl.constexpr, WRITE_H: gl.constexpr,
                      QUANT_H: gl.constexpr):
    """One warpgroup: rows [r0 + ROW_OFFSET, + HALF_M) of every tile the program owns, G and U through
    `_consume_wide_tile`, then the SiTU epilogue."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, _SCALE_N, 32])
    it = 0
    for t in range(gl.program_id(0), n_tiles_m * gl.cdiv(I, _SCALE_N), gl.num_programs(0)):
        e, r0, r1, col0, second, local, off_b, n_k = _mm_tile(t, tiles_ptr, n_tiles_m, I, I, K, _SCALE_N, BLOCK_K,
                                                               GROUP_M)
        if e >= 0:
            sb_off = (e.to(gl.int64) * (I // _SCALE_N) + col0 // _SCALE_N) * n_k
            rows = r0 + ROW_OFFSET + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, mma_layout))
            rmask = rows < r1
            r64 = rows.to(gl.int64)
            acc_g, acc_u = _consume_wide_tile(a_bufs, b_bufs, ready, empty, as_ptr + r64 * n_k, rmask, bs_ptr + sb_off,
                                              bs2_ptr + sb_off, it, n_k, HALF_M, STAGES)
            it += n_k
            cols = col0 + gl.arange(0, _SCALE_N, layout=gl.SliceLayout(0, mma_layout))
            m = rmask[:, None] & (cols < I)[None, :]
            g = acc_g.to(ACT_DTYPE)  # (the activation dtype: G | U as the unfused launch stores them)
            u = acc_u.to(ACT_DTYPE)
            if SAVE_GU:
                gp = gu_ptr + r64[:, None] * (2 * I) + cols[None, :]
                gl.store(gp, g, mask=m)
                gl.store(gp + I, u, mask=m)
            h = situ_h(g.to(gl.float32), u.to(gl.float32), beta, linear_beta)
            if WRITE_H:
                gl.store(h_ptr + r64[:, None] * I + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=m)
            if QUANT_H:
                store_row_quant(h, m, rmask, r64, cols, col0 // _SCALE_N, hq_ptr, I, hs_ptr, I // _SCALE_N)


@gluon.jit
def _scaled_gate_up_kernel(a_desc, b_desc, b2_desc, as_ptr, bs_ptr, bs2_ptr, gu_ptr, h_ptr, hq_ptr, hs_ptr, tiles_ptr,
                           n_tiles_m, I, K, beta, linear_beta, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
                           GROUP_M: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                           ACT_DTYPE: gl.constexpr, SAVE_GU: gl.constexpr, WRITE_H: gl.constexpr, QUANT_H: gl.constexpr,
                           num_warps: gl.constexpr):
    """gluon_gemm's partitions (two consumer warpgroups, a one-warp TMA producer) with a ring slot holding the
    W1 box over the W3 box ([2 x 128, BLOCK_K])."""
    HALF_M: gl.constexpr = BLOCK_M // 2
    a_lo, a_hi, b_bufs, ready, empty = _ring_of(
        a_desc.dtype, HALF_M, BLOCK_K, gl.constexpr(a_desc.layout), b_desc.dtype, 2 * _SCALE_N, BLOCK_K,
        gl.constexpr(b_desc.layout), STAGES)
    gl.warp_specialize([
        (_gate_up_consumer, (a_lo, b_bufs, ready, empty, as_ptr, bs_ptr, bs2_ptr, gu_ptr, h_ptr, hq_ptr, hs_ptr,
                             tiles_ptr, n_tiles_m, I, K, beta, linear_beta, 0, HALF_M, BLOCK_K, GROUP_M, STAGES,
                             ACT_DTYPE, SAVE_GU, WRITE_H, QUANT_H)),
        (_gate_up_consumer, (a_hi, b_bufs, ready, empty, as_ptr, bs_ptr, bs2_ptr, gu_ptr, h_ptr, hq_ptr, hs_ptr,
                             tiles_ptr, n_tiles_m, I, K, beta, linear_beta, HALF_M, HALF_M, BLOCK_K, GROUP_M, STAGES,
                             ACT_DTYPE, SAVE_GU, WRITE_H, QUANT_H)),
        (_mm_producer, (a_desc, b_desc, b2_desc, ready, empty, a_lo, a_hi, b_bufs, tiles_ptr, n_tiles_m, I, I, K,
                        _SCALE_N, BLOCK_K, GROUP_M, STAGES, HALF_M, True)),
    ], [4, 1], [CONSUMER_REGS, 40])


def scaled_gate_up(xq: torch.Tensor, xs: torch.Tensor, w1: tuple[torch.Tensor, torch.Tensor],
                   w3: tuple[torch.Tensor, torch.Tensor], tiles: torch.Tensor, beta: float, linear_beta: float,
                   gu: torch.Tensor | None, h: torch.Tensor | None, hq: torch.Tensor | None, hs: torch.Tensor | None,
                   act_dtype: torch.dtype, tile: GluonTile = DEFAULT_TILE) -> None:
    """Fill gu [P, 2I] (G | U, if given), h [P, I] (if given; both act_dtype, bf16 or fp32), hq [P, I] e4m3 and hs
    [P, I / 128] (if given) from
    xq [P, K] e4m3 with xs [P, K / 128] and w1 / w3 = (e4m3 [E, I, K], scales [E, I / 128, K / 128]); tiles =
    RoutingPlan.tiles(tile.block_m). The caller (grouped_gemm.gate_up) has checked the shapes."""
    tile.validate()
    (w1q, w1s), (w3q, w3s) = w1, w3
    P, K = xq.shape
    E, I, _ = w1q.shape
    if I % QUANT_BLOCK or K % QUANT_BLOCK or (hq is None) != (hs is None):
        raise ValueError(f"w1: expected I and K divisible by {QUANT_BLOCK} (and hq with hs), got {tuple(w1q.shape)}")
    if act_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"act_dtype: expected bf16 or fp32, got {act_dtype}")
    outs = [t for t in (gu, h, hq) if t is not None]
    if P == 0 or not outs:
        return
    a_desc = _descriptor(xq, [tile.block_m // 2, tile.block_k])
    b_desc = _descriptor(w1q.view(E * I, K), [QUANT_BLOCK, tile.block_k])
    b2_desc = _descriptor(w3q.view(E * I, K), [QUANT_BLOCK, tile.block_k])
    n_m = tiles.shape[0]
    grid = (_programs(n_m * (I // QUANT_BLOCK), tile, xq.device),)
    _scaled_gate_up_kernel[grid](
        a_desc, b_desc, b2_desc, xs, w1s, w3s, gu if gu is not None else outs[0], h if h is not None else outs[0],
        hq if hq is not None else outs[0], hs if hs is not None else xs, tiles, n_m, I, K, float(beta),
        float(linear_beta), BLOCK_M=tile.block_m, BLOCK_K=tile.block_k, GROUP_M=tile.group_m, STAGES=tile.stages,
        CONSUMER_REGS=tile.consumer_regs, ACT_DTYPE=_GL_DTYPES[act_dtype], SAVE_GU=gu is not None,
        WRITE_H=h is not None, QUANT_H=hq is not None, num_warps=4, maxnreg=_MAXNREG)
