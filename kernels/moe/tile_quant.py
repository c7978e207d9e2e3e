"""Both FP8 quantisations of a SiTU tensor in one pass over its 128-token tiles, for the two tensors FP8_FULL needs
in both forms: H = SiTU(G) * cap(U) in the forward (from G | U) and dG | dU in the backward (from dH and G | U).
The 1 x 128 rows feed the next GEMM (the down GEMM, the gate/up dgrad) and the 128-token blocks the wgrad
(dW2, dW1 | dW3); the outputs are `fp8_grad.quantize_rows`' and `fp8_grad.quantize_token_blocks`' layouts with the
unfused passes' bits, and the tensor itself is never written in the activations' dtype (nor read back).

A program owns one token tile (an expert's rows r0 .. r1 <= r0 + 128: `fp8_grad.token_block_tiles`) and one
128-column block of the output. A first sweep over the tile, `TILE_PASS_ROWS` rows at a time, computes the values,
stores each row's e4m3 values and scale and keeps each column's largest magnitude; a second sweep computes the
values again (the same arithmetic, so the same bits; the inputs now come from L2) and stores them quantised by
their column's scale, transposed into the tile's token block, zeros past the expert's rows. The recomputation
costs SiTU's arithmetic and an L2 read twice instead of the tensor's write and read through HBM; holding the
tile's values for both quantisations at once needs ~128 x 256 fp32 values a program (one program an SM).

Values: H's rows are quantised from the fp32 H and its token blocks from H rounded to the activations' dtype (as
`grouped_gemm.situ_quant` and the token-block pass over the stored H do); dG | dU rounded to the activations'
dtype for both (as `fp8_grad.situ_backward_rows` and the pass over the stored dG | dU). Spec: naive.py's
quantisers of those tensors (tests/kernels/test_moe_fp8_grad.py compares with the two-pass path bit for bit)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3_kernels.moe.permute import QUANT_BLOCK, e4m3_scale, e4m3_values, store_row_quant
from k3_kernels.situ.fused import situ_grads, situ_h

# rows a sweep step takes and the program's warps: a program's rows are independent, so these set its size (and
# how much it holds in registers), not the bits (benchmarks/moe.py --gluon-gemms times the passes)
TILE_PASS_ROWS, TILE_PASS_WARPS = 32, 4


@triton.jit
def _situ_values(gu_ptr, dh_ptr, rows, rmask, cols, I, beta, linear_beta, BACKWARD: tl.constexpr):
    """Rows `rows` (zeros outside rmask) of one 128-column block: (forward) H in fp32 for its rows and H rounded to
    G | U's dtype for its token blocks; (backward) dG and dU, each rounded to that dtype."""
    r64 = rows.to(tl.int64)
    m = rmask[:, None]
    gp = gu_ptr + r64[:, None] * (2 * I) + cols[None, :]
    g = tl.load(gp, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gp + I, mask=m, other=0.0).to(tl.float32)
    act = gu_ptr.dtype.element_ty
    if BACKWARD:
        dh = tl.load(dh_ptr + r64[:, None] * I + cols[None, :], mask=m, other=0.0).to(tl.float32)
        dg, du = situ_grads(dh, g, u, beta, linear_beta)
        first = dg.to(act).to(tl.float32)
        second = du.to(act).to(tl.float32)
    else:
        first = situ_h(g, u, beta, linear_beta)
        second = first.to(act).to(tl.float32)
    return first, second


@triton.jit
def _situ_tile_quant_kernel(gu_ptr, dh_ptr, tiles_ptr, q_ptr, s_ptr, tq_ptr, ts_ptr, I, n_tiles, beta, linear_beta,
                            BACKWARD: tl.constexpr, ROWS: tl.constexpr, QB: tl.constexpr):
    """Program (token tile t, column block cb): the forward's H block -> H's rows (q [P, I], s [P, I / QB]) and
    token block (tq [I, T QB], ts [T, I]); the backward's dG and dU blocks -> rows of dG | dU (q [P, 2I]; dG's
    block cb, dU's I / QB + cb) and their token blocks (tq [2I, T QB]: dG's channel c in row c, dU's in I + c)."""
    t = tl.program_id(0)
    cb = tl.program_id(1)
    e = tl.load(tiles_ptr + t * 3)
    if e >= 0:
        r0 = tl.load(tiles_ptr + t * 3 + 1)
        r1 = tl.load(tiles_ptr + t * 3 + 2)
        cols = cb * QB + tl.arange(0, QB)
        C = 2 * I if BACKWARD else I
        amax_a = tl.zeros((QB,), dtype=tl.float32)
        amax_b = tl.zeros((QB,), dtype=tl.float32)
        for r in range(0, QB, ROWS):
            rows = r0 + r + tl.arange(0, ROWS)
            rmask = rows < r1
            r64 = rows.to(tl.int64)
            first, second = _situ_values(gu_ptr, dh_ptr, rows, rmask, cols, I, beta, linear_beta, BACKWARD)
            store_row_quant(first, rmask[:, None], rmask, r64, cols, cb, q_ptr, C, s_ptr, C // QB)
            if BACKWARD:
                store_row_quant(second, rmask[:, None], rmask, r64, I + cols, I // QB + cb, q_ptr, C, s_ptr, C // QB)
                amax_a = tl.maximum(amax_a, tl.max(tl.abs(tl.where(rmask[:, None], first, 0.0)), axis=0))
            amax_b = tl.maximum(amax_b, tl.max(tl.abs(tl.where(rmask[:, None], second, 0.0)), axis=0))
        scale_b = e4m3_scale(amax_b)  # the forward's H block / the backward's dU block
        scale_a = e4m3_scale(amax_a)  # (the backward's dG block)
        for r in range(0, QB, ROWS):
            rows = r0 + r + tl.arange(0, ROWS)
            rmask = rows < r1
            first, second = _situ_values(gu_ptr, dh_ptr, rows, rmask, cols, I, beta, linear_beta, BACKWARD)
            slots = t * QB + r + tl.arange(0, ROWS)
            vb = e4m3_values(tl.where(rmask[:, None], second, 0.0), scale_b[None, :]).to(tq_ptr.dtype.element_ty)
            if BACKWARD:
                va = e4m3_values(tl.where(rmask[:, None], first, 0.0), scale_a[None, :]).to(tq_ptr.dtype.element_ty)
                tl.store(tq_ptr + cols.to(tl.int64)[None, :] * (n_tiles * QB) + slots[:, None], va)
                tl.store(tq_ptr + (I + cols).to(tl.int64)[None, :] * (n_tiles * QB) + slots[:, None], vb)
            else:
                tl.store(tq_ptr + cols.to(tl.int64)[None, :] * (n_tiles * QB) + slots[:, None], vb)
        if BACKWARD:
            tl.store(ts_ptr + t.to(tl.int64) * C + cols, scale_a)
            tl.store(ts_ptr + t.to(tl.int64) * C + I + cols, scale_b)
        else:
            tl.store(ts_ptr + t.to(tl.int64) * C + cols, scale_b)


def _launch(gu: torch.Tensor, dh: torch.Tensor | None, tiles: torch.Tensor, beta: float, linear_beta: float):
    P, I2 = gu.shape
    I = I2 // 2
    backward = dh is not None
    if I % QUANT_BLOCK or I2 != 2 * I or not gu.is_contiguous():
        raise ValueError(f"gu: expected contiguous [P, 2I] with I % {QUANT_BLOCK} == 0, got {tuple(gu.shape)}")
    if backward and (dh.shape != (P, I) or not dh.is_contiguous() or dh.dtype != gu.dtype):
        raise ValueError(f"dh: expected contiguous [{P}, {I}] {gu.dtype}, got {tuple(dh.shape)} {dh.dtype}")
    if tiles.dim() != 2 or tiles.shape[1] != 3:
        raise ValueError(f"tiles: expected fp8_grad.token_block_tiles' [T, 3], got {tuple(tiles.shape)}")
    C, T, dev = I2 if backward else I, tiles.shape[0], gu.device
    q = torch.empty(P, C, device=dev, dtype=torch.float8_e4m3fn)
    s = torch.empty(P, C // QUANT_BLOCK, device=dev, dtype=torch.float32)
    tq = torch.empty(C, T * QUANT_BLOCK, device=dev, dtype=torch.float8_e4m3fn)
    ts = torch.empty(T, C, device=dev, dtype=torch.float32)
    if P and T:
        _situ_tile_quant_kernel[(T, I // QUANT_BLOCK)](gu, gu if dh is None else dh, tiles, q, s, tq, ts, I, T,
                                                     float(beta), float(linear_beta), BACKWARD=backward,
                                                     ROWS=TILE_PASS_ROWS, QB=QUANT_BLOCK, num_warps=TILE_PASS_WARPS)
    return (q, s), (tq, ts)


def situ_rows_and_blocks(gu: torch.Tensor, tiles: torch.Tensor, beta: float, linear_beta: float
                         ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """H = SiTU(G) * cap(U) from gu [P, 2I] (expert-sorted rows) -> (H's FP8 rows and scales, H's token blocks
    and scales) for `tiles` = fp8_grad.token_block_tiles(plan)[0]: the bits of `grouped_gemm.situ_quant`'s rows
    and of `fp8_grad.quantize_token_blocks` over the stored H, without H."""
    return _launch(gu, None, tiles, beta, linear_beta)


def situ_backward_rows_and_blocks(dh: torch.Tensor, gu: torch.Tensor, tiles: torch.Tensor, beta: float,
                                  linear_beta: float
                                  ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """dG | dU of SiTU-and-mul from dh [P, I] and gu [P, 2I] -> (their FP8 rows and scales, their token blocks and
    scales): the bits of `fp8_grad.situ_backward_rows`' rows and of `fp8_grad.quantize_token_blocks` over its
    dG | dU, without dG | dU."""
    return _launch(gu, dh, tiles, beta, linear_beta)
