"""FP8 (e4m3) backward GEMMs of the routed experts, DeepSeek-V3's recipe: the gradients that feed a dgrad are
quantised 1 x 128 along its K (the row quantiser, `quantize_rows`), the weights come as 128 x 128 blocks of their
transposes, and the wgrad's two operands are quantised in 128-token blocks along the tokens it sums over
(`quantize_token_blocks`: each expert's rows in blocks of 128 that never cross an expert, stored transposed and
zero-padded so that a block is one contiguous K step). Every K step's fp32 partial is scaled and accumulated in
order, one program per output tile: deterministic, no atomics.

  dH   = dY  W2_e          A = dY q (1 x 128 along L),        B = W2_e^T q (128 x 128)
  dX   = [dG | dU] [W1_e ; W3_e]   A = dGU q (1 x 128 along 2I), B = [W1_e^T | W3_e^T] q
  dW2_e = dY_e^T H_e       A = dY^T, B = H^T      (128 tokens x 1 blocks, per expert)
  dW1_e | dW3_e = [dG | dU]_e^T X_e                (the same)

Dgrads reuse the forward's block-scaled GEMM (`grouped_gemm.scaled_mm`: Triton, or gluon_gemm on sm_90); the wgrad
is `_wgrad_kernel` here (Triton, the CPU-tested path) or gluon_gemm's wgrad on sm_90. Spec: naive.py
(naive_quant_rows, naive_quant_token_blocks, naive_wgrad_fp8).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3_kernels.launch import cdiv
from k3_kernels.moe import gluon_gemm
from k3_kernels.moe import grouped_gemm as gg
from k3_kernels.moe.permute import (QUANT_BLOCK, GatheredRows, RoutingPlan, e4m3_scales, e4m3_values, load_rows,
                                    row_pass_grid, row_pass_program, store_row_quant)
from k3_kernels.situ.fused import situ_grads


# ------------------------------------------------------------------------------------------------- quantisers
# rows a program of the row passes (quantize_rows, situ_backward_rows) and its warps: rows are independent, so these
# set the programs' size only, not the bits (benchmarks/moe.py --gluon-gemms ... --pass-settings sweeps them; the
# choice: kernels/moe/NOTES.md, session 44)
ROW_PASS_ROWS, ROW_PASS_WARPS = 8, 4


@triton.jit
def _quant_rows_kernel(x_ptr, x_stride, order_ptr, w_ptr, top_k, q_ptr, s_ptr, P, C, GATHER: tl.constexpr,
                       HAS_W: tl.constexpr, ROUND: tl.constexpr, BLOCK_P: tl.constexpr, QB: tl.constexpr):
    row_block, cb = row_pass_program(tl.program_id(0), C // QB)
    rows = row_block * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = cb * QB + tl.arange(0, QB)
    rmask = rows < P
    r64 = rows.to(tl.int64)
    v = load_rows(x_ptr, x_stride, order_ptr, w_ptr, top_k, rows, rmask, cols, rmask[:, None], GATHER, HAS_W, ROUND)
    store_row_quant(v, rmask[:, None], rmask, r64, cols, cb, q_ptr, C, s_ptr, C // QB)


def _source(x: torch.Tensor | GatheredRows, name: str) -> tuple[int, int, tuple, dict]:
    """(rows, width, `load_rows`' arguments, its constexprs) of a tensor or a GatheredRows."""
    if isinstance(x, GatheredRows):
        x.check(name)
        P, C = x.rows, x.x.shape[1]
        args, consts = x.kernel_args()
    else:
        if x.dim() != 2 or x.stride(1) != 1:
            raise ValueError(f"{name}: expected [P, C] with contiguous rows, got {tuple(x.shape)}")
        (P, C), args, consts = x.shape, (x, x.stride(0), x, x, 1), dict(GATHER=False, HAS_W=False, ROUND=tl.float32)
    if C % QUANT_BLOCK:
        raise ValueError(f"{name}: expected a width divisible by {QUANT_BLOCK}, got {C}")
    return P, C, args, consts


def quantize_rows(x: torch.Tensor | GatheredRows) -> tuple[torch.Tensor, torch.Tensor]:
    """x [P, C] (C % 128 == 0, rows may be strided; or rows gathered in place) -> (q e4m3 [P, C], scale fp32
    [P, C / 128]): 1 x 128 blocks."""
    P, C, args, consts = _source(x, "x")
    dev = args[0].device
    q = torch.empty(P, C, device=dev, dtype=torch.float8_e4m3fn)
    s = torch.empty(P, C // QUANT_BLOCK, device=dev, dtype=torch.float32)
    if P:
        BP = ROW_PASS_ROWS
        _quant_rows_kernel[row_pass_grid(P, BP, C // QUANT_BLOCK)](*args, q, s, P, C, **consts, BLOCK_P=BP,
                                                                   QB=QUANT_BLOCK, num_warps=ROW_PASS_WARPS)
    return q, s


@triton.jit
def _situ_bwd_rows_kernel(dh_ptr, gu_ptr, dgu_ptr, q_ptr, s_ptr, P, I, beta, linear_beta, BLOCK_M: tl.constexpr,
                          QB: tl.constexpr):
    """SiTU's backward (grouped_gemm._situ_bwd_kernel's arithmetic) and dG | dU's 1 x QB row quantisation of the
    rounded result on the way out: one read of dH and G | U for both."""
    row_block, cb = row_pass_program(tl.program_id(0), I // QB)
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = cb * QB + tl.arange(0, QB)
    rmask = rows < P
    r64 = rows.to(tl.int64)
    dh = tl.load(dh_ptr + r64[:, None] * I + cols[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    gp = gu_ptr + r64[:, None] * (2 * I) + cols[None, :]
    g = tl.load(gp, mask=rmask[:, None], other=0.0).to(tl.float32)
    u = tl.load(gp + I, mask=rmask[:, None], other=0.0).to(tl.float32)
    dg, du = situ_grads(dh, g, u, beta, linear_beta)
    dg = dg.to(dgu_ptr.dtype.element_ty)
    du = du.to(dgu_ptr.dtype.element_ty)
    out = dgu_ptr + r64[:, None] * (2 * I) + cols[None, :]
    tl.store(out, dg, mask=rmask[:, None])
    tl.store(out + I, du, mask=rmask[:, None])
    store_row_quant(dg, rmask[:, None], rmask, r64, cols, cb, q_ptr, 2 * I, s_ptr, 2 * I // QB)
    store_row_quant(du, rmask[:, None], rmask, r64, I + cols, I // QB + cb, q_ptr, 2 * I, s_ptr, 2 * I // QB)


def situ_backward_rows(dh: torch.Tensor, gu: torch.Tensor, beta: float, linear_beta: float
                       ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """(dG | dU, its FP8 rows) = (grouped_gemm.situ_backward(dh, gu, ...), quantize_rows of that), the same bits,
    from one read of dh [P, I] and gu [P, 2I] (contiguous; I % 128 == 0, as the FP8 layer needs anyway)."""
    P, I = dh.shape
    if I % QUANT_BLOCK or gu.shape != (P, 2 * I) or not (dh.is_contiguous() and gu.is_contiguous()):
        raise ValueError(f"dh, gu: expected contiguous [P, I], [P, 2I] with I % {QUANT_BLOCK} == 0, got "
                         f"{tuple(dh.shape)}, {tuple(gu.shape)}")
    dgu = torch.empty(P, 2 * I, device=dh.device, dtype=gu.dtype)
    q = torch.empty(P, 2 * I, device=dh.device, dtype=torch.float8_e4m3fn)
    s = torch.empty(P, 2 * I // QUANT_BLOCK, device=dh.device, dtype=torch.float32)
    if P:
        BM = ROW_PASS_ROWS
        _situ_bwd_rows_kernel[row_pass_grid(P, BM, I // QUANT_BLOCK)](dh, gu, dgu, q, s, P, I, float(beta),
                                                                      float(linear_beta), BLOCK_M=BM,
                                                                      QB=QUANT_BLOCK, num_warps=ROW_PASS_WARPS)
    return dgu, (q, s)


def token_block_tiles(plan: RoutingPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(tiles = plan.tiles(128): one row per 128-token block of an expert, expert e's blocks
    [tile_offsets[e], tile_offsets[e + 1]) -- int64 [E + 1], computed on the device)."""
    tiles = plan.tiles(QUANT_BLOCK)
    per = (plan.counts + QUANT_BLOCK - 1) // QUANT_BLOCK
    return tiles, torch.cat([per.new_zeros(1), torch.cumsum(per, 0)])


# columns a program of the token-block pass and its warps (program size only, not the bits; swept with the above)
TOKEN_BLOCK_COLUMNS, TOKEN_BLOCK_WARPS = 64, 4


@triton.jit
def _token_block_kernel(x_ptr, x_stride, order_ptr, w_ptr, top_k, tiles_ptr, tq_ptr, ts_ptr, C, n_tiles,
                        GATHER: tl.constexpr, HAS_W: tl.constexpr, ROUND: tl.constexpr, QB: tl.constexpr,
                        BLOCK_C: tl.constexpr):
    """Program (tile t, BLOCK_C columns): the tile's rows (past the expert: zeros) quantised per column (QB x 1),
    stored transposed in column block t of tq, the scales in row t of ts. Columns are independent: BLOCK_C only
    sets the program's size (smaller: more programs an SM in flight), not the bits."""
    t = tl.program_id(0)
    e = tl.load(tiles_ptr + t * 3)
    if e >= 0:
        r0 = tl.load(tiles_ptr + t * 3 + 1)
        r1 = tl.load(tiles_ptr + t * 3 + 2)
        rows = r0 + tl.arange(0, QB)
        rmask = rows < r1
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        v = load_rows(x_ptr, x_stride, order_ptr, w_ptr, top_k, rows, rmask, cols, rmask[:, None], GATHER, HAS_W,
                      ROUND).to(tl.float32)
        camax = tl.max(tl.abs(v), axis=0)
        cscale, cinverse = e4m3_scales(camax)
        cq = e4m3_values(v, cinverse[None, :])
        slots = t * QB + tl.arange(0, QB)
        tl.store(tq_ptr + cols.to(tl.int64)[None, :] * (n_tiles * QB) + slots[:, None],
                 cq.to(tq_ptr.dtype.element_ty))
        tl.store(ts_ptr + t.to(tl.int64) * C + cols, cscale)


def quantize_token_blocks(x: torch.Tensor | GatheredRows, tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [P, C] (expert-sorted rows, or gathered in place; C % 128 == 0) -> (q e4m3 [C, T 128], scale fp32 [T, C])
    for the T tiles of
    `token_block_tiles`: column block t holds tile t's rows quantised per channel (128 x 1 blocks), transposed,
    and row t of the scales their scales (a block's scales contiguous: the GEMMs read one row a K step); unused
    tiles are left unwritten (no expert's range reaches them).

    A tensor that needs both quantisations (dY, dG | dU) goes through `quantize_rows` and this pass, two reads: one
    pass doing both needs 168 registers a thread at 8 warps, one program an SM, which leaves the memory system idle
    while a program reduces and stores (kernels/moe/NOTES.md, session 31)."""
    P, C, args, consts = _source(x, "x")
    T = tiles.shape[0]
    dev = args[0].device
    tq = torch.empty(C, T * QUANT_BLOCK, device=dev, dtype=torch.float8_e4m3fn)
    ts = torch.empty(T, C, device=dev, dtype=torch.float32)
    if P and T:
        _token_block_kernel[(T, C // TOKEN_BLOCK_COLUMNS)](*args, tiles, tq, ts, C, T, **consts, QB=QUANT_BLOCK,
                                                           BLOCK_C=TOKEN_BLOCK_COLUMNS, num_warps=TOKEN_BLOCK_WARPS)
    return tq, ts


# ---------------------------------------------------------------------------------------------------- wgrad
@triton.jit
def _wgrad_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, out_ptr, out2_ptr, tile_off_ptr, M, N, M_SPLIT, n_tiles,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QB: tl.constexpr):
    """out[e, m, n] = sum over expert e's token blocks t of (A_t B_t^T * s_a[t, m]) * s_b[t, n], A = [M, T QB],
    B = [N, T QB] (token-block-quantised, transposed). Rows m >= M_SPLIT go to out2 (row m - M_SPLIT)."""
    e = tl.program_id(1).to(tl.int64)
    n_tn = tl.cdiv(N, BLOCK_N)
    tm = tl.program_id(0) // n_tn
    tn = tl.program_id(0) % n_tn
    t0 = tl.load(tile_off_ptr + e)
    t1 = tl.load(tile_off_ptr + e + 1)
    ms = tm * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = tn * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, QB)
    K = n_tiles * QB
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(t0, t1):
        a = tl.load(a_ptr + ms.to(tl.int64)[:, None] * K + t * QB + kk[None, :])
        b = tl.load(b_ptr + ns.to(tl.int64)[None, :] * K + t * QB + kk[:, None])
        sa = tl.load(as_ptr + t * M + ms)  # (T M and T N stay far below 2^31)
        sb = tl.load(bs_ptr + t * N + ns)
        acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
    second = tm * BLOCK_M >= M_SPLIT
    rows = ms - tl.where(second, M_SPLIT, 0)
    m_out = tl.where(second, M - M_SPLIT, M_SPLIT)
    base = tl.where(second, out2_ptr, out_ptr)
    tl.store(base + e * m_out * N + rows.to(tl.int64)[:, None] * N + ns[None, :], acc.to(out_ptr.dtype.element_ty))


def _wgrad_tile(device: torch.device) -> tuple[int, int, int]:
    return (128, 128, 8) if device.type == "cuda" else (32, 32, 4)


def wgrad_fp8(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor], tile_offsets: torch.Tensor,
              n_experts: int, out_dtype: torch.dtype, split: int | None = None
              ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-expert weight gradient from token-block-quantised operands: a = (q [M, T 128], scale [T, M]),
    b = (q [N, T 128], scale [T, N]) -> [E, M, N] (experts without rows: zeros); with `split`, rows [0, split)
    and [split, M) as two tensors [E, split, N], [E, M - split, N] (dW1, dW3 from [dG | dU])."""
    (aq, a_s), (bq, b_s) = a, b
    M, N = aq.shape[0], bq.shape[0]
    T = a_s.shape[0]
    if (aq.shape[1] != T * QUANT_BLOCK or bq.shape[1] != T * QUANT_BLOCK or a_s.shape != (T, M)
            or b_s.shape != (T, N)):
        raise ValueError(f"a, b: expected [M, {T * QUANT_BLOCK}] / [N, {T * QUANT_BLOCK}] with scales [{T}, .], got "
                         f"{tuple(aq.shape)} / {tuple(bq.shape)} / {tuple(a_s.shape)} / {tuple(b_s.shape)}")
    if M % QUANT_BLOCK or N % QUANT_BLOCK or (split is not None and split % QUANT_BLOCK):
        raise ValueError(f"a, b: rows must be multiples of {QUANT_BLOCK}, got {M}, {N}, split {split}")
    s = M if split is None else split
    out = torch.empty(n_experts, s, N, device=aq.device, dtype=out_dtype)
    out2 = torch.empty(n_experts, M - s, N, device=aq.device, dtype=out_dtype) if split is not None else out
    if n_experts == 0:
        return out if split is None else (out, out2)
    if gg.gemm_kernels_for(aq.device, QUANT_BLOCK, N) is gg.GemmKernels.GLUON:
        gluon_gemm.scaled_wgrad(aq, a_s, bq, b_s, tile_offsets, out, out2, s, tile=gluon_gemm.DEFAULT_TILE)
    else:
        BM, BN, warps = _wgrad_tile(aq.device)
        _wgrad_kernel[(cdiv(M, BM) * cdiv(N, BN), n_experts)](aq, a_s, bq, b_s, out, out2, tile_offsets, M, N, s, T,
                                                             BLOCK_M=BM, BLOCK_N=BN, QB=QUANT_BLOCK,
                                                             num_warps=warps, num_stages=3 if aq.is_cuda else 1)
    return out if split is None else (out, out2)
