"""Both FP8 quantisations of expert-sorted rows in one pass on sm_90 (Gluon): the 1 x 128 rows a GEMM reads along
K and the 128-token blocks a wgrad reads, with the bits of the CPU-tested Triton passes they replace (this
kernel's spec): `fp8_grad.quantize_rows` + `fp8_grad.quantize_token_blocks` for the permuted tokens X and for
dY (gathered in place), `grouped_gemm.situ_quant` + the token-block pass over H, and
`fp8_grad.situ_backward_rows` + the token-block pass over dG | dU (SiTU computed here from G | U and dH).

Why: FP8_FULL needs both forms of X (the gate/up's rows, dW1 | dW3's token blocks), of H (the down GEMM's, dW2's),
of dY (the down dgrad's, dW2's) and of dG | dU (the gate/up dgrad's, dW1 | dW3's). Two passes read each tensor
twice (and H and dG | dU are written in bf16 only to be read back); one pass reads once and writes the FP8 bytes
alone. A Triton program cannot hold a token tile for the second quantisation without ~128 x 128 values in
registers (kernels/moe/NOTES.md, sessions 31 and 41); here the tile waits in shared memory.

A program owns one token tile (an expert's rows r0 .. r1 <= r0 + 128: `fp8_grad.token_block_tiles`) and one
128-column block. First sweep, ROWS rows at a time in a row-major layout (a thread 8 adjacent columns): load,
quantise each row (scale = amax / 448), store its e4m3 values and scale, and keep the rows (rounded as loaded,
zeros past the expert) in shared memory. Second sweep, COLS columns at a time in a column-major layout (a warp 32
adjacent tokens of one column): each column's scale over the tile's 128 tokens, its e4m3 values stored
transposed into the tile's token block. Shared memory is swizzled in 4-byte units by the row, so the
second sweep's column reads spread over the banks.

Gluon has no interpreter: this runs only on sm_90 (tests/kernels/test_moe_fp8_grad.py compares it with the
Triton passes bit for bit there; on CPU the build test compiles it for sm_90a). Opt-in: `fp8_grad.ONE_PASS_QUANT`.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from k3_kernels.moe.permute import QUANT_BLOCK, e4m3_scale, e4m3_values, load_rows, store_row_quant
from k3_kernels.situ.fused import situ_grads, situ_h

_QB = gl.constexpr(QUANT_BLOCK)
# ((e4m3 rows [P, C], their scales [P, C / 128]), (e4m3 token blocks [C, T 128], their scales [T, C]))
RowsAndBlocks = tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# rows a step of the first sweep (SiTU's: fewer, its arithmetic holds more registers), columns a step of the
# second, warps: a program's size, not its bits
ROWS, SITU_ROWS, COLS, WARPS = 32, 16, 32, 4


# the first sweep's row-major layout (a thread 8 adjacent columns) and the second's column-major one (a warp 32
# adjacent tokens of one column), for WARPS warps
_ROW_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0]))
_COL_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 1], [32, 1], [1, WARPS], [0, 1]))


@gluon.jit
def _tile_buffer(dt: gl.constexpr, PHASES: gl.constexpr):
    """A token tile's 128 x 128 values in shared memory, swizzled in 4-byte units by the row (PHASES phases: the
    first sweep's row step, which a slice may not split), so the second sweep's column reads spread over the
    banks."""
    vec: gl.constexpr = 32 // dt.primitive_bitwidth
    return gl.allocate_shared_memory(dt, [_QB, _QB], gl.SwizzledSharedLayout(vec, 1, PHASES, [1, 0]))


@gluon.jit
def _program_tile(tiles_ptr):
    """This program's token tile t and column block cb, the tile's expert (-1: an unused tile) and its rows r0 ..
    r1 (the tile table's entries, valid for every tile)."""
    t = gl.program_id(0)
    row = tiles_ptr + t * 3
    return t, gl.program_id(1), gl.load(row), gl.load(row + 1), gl.load(row + 2)


@gluon.jit
def _step_rows(r0, r, r1, ROWS_STEP: gl.constexpr):
    """The first sweep's rows r0 + r .. + ROWS_STEP (row-major layout) and which of them are the expert's."""
    rows = r0 + r + gl.arange(0, ROWS_STEP, layout=gl.SliceLayout(1, _ROW_LAYOUT))
    return rows, rows < r1


@gluon.jit
def _token_blocks(tile, t, col0, tq_ptr, ts_ptr, C, n_tiles, COLS_STEP: gl.constexpr):
    """The second sweep over one tile buffer (columns col0 .. col0 + 127 of the output): each column's scale over
    the tile's 128 tokens and its e4m3 values, stored transposed into token block t (quantize_token_blocks' bits)."""
    slots = t * _QB + gl.arange(0, _QB, layout=gl.SliceLayout(1, _COL_LAYOUT))
    for c in gl.static_range(0, _QB, COLS_STEP):
        vt = tile.slice(c, COLS_STEP, dim=1).load(_COL_LAYOUT).to(gl.float32)
        cols = col0 + c + gl.arange(0, COLS_STEP, layout=gl.SliceLayout(0, _COL_LAYOUT))
        scale = e4m3_scale(gl.max(gl.abs(vt), axis=0))
        gl.store(tq_ptr + cols.to(gl.int64)[None, :] * (n_tiles * _QB) + slots[:, None],
                 e4m3_values(vt, scale[None, :]).to(tq_ptr.dtype.element_ty))
        gl.store(ts_ptr + t.to(gl.int64) * C + cols, scale)


@gluon.jit
def _rows_and_blocks_kernel(x_ptr, x_stride, order_ptr, w_ptr, top_k, tiles_ptr, q_ptr, s_ptr, tq_ptr, ts_ptr, C,
                            n_tiles, GATHER: gl.constexpr, HAS_W: gl.constexpr, ROUND: gl.constexpr,
                            ROWS_STEP: gl.constexpr, COLS_STEP: gl.constexpr, num_warps: gl.constexpr):
    """Program (token tile t, column block cb) of expert-sorted rows (or the GatheredRows `load_rows` reads):
    their 1 x 128 rows (store_row_quant, as quantize_rows) and the tile's token block."""
    if HAS_W:
        tile = _tile_buffer(ROUND, ROWS_STEP)
    else:
        tile = _tile_buffer(x_ptr.dtype.element_ty, ROWS_STEP)
    t, cb, e, r0, r1 = _program_tile(tiles_ptr)
    if e >= 0:
        cols = cb * _QB + gl.arange(0, _QB, layout=gl.SliceLayout(0, _ROW_LAYOUT))
        for r in gl.static_range(0, _QB, ROWS_STEP):
            rows, rmask = _step_rows(r0, r, r1, ROWS_STEP)
            v = load_rows(x_ptr, x_stride, order_ptr, w_ptr, top_k, rows, rmask, cols, rmask[:, None], GATHER, HAS_W,
                          ROUND)
            store_row_quant(v, rmask[:, None], rmask, rows.to(gl.int64), cols, cb, q_ptr, C, s_ptr, C // _QB)
            tile.slice(r, ROWS_STEP).store(v)  # (zeros past the expert: load_rows' other)
        gl.thread_barrier()  # every row in shared memory before any column is read
        _token_blocks(tile, t, cb * _QB, tq_ptr, ts_ptr, C, n_tiles, COLS_STEP)


@gluon.jit
def _situ_rows_and_blocks_kernel(gu_ptr, dh_ptr, tiles_ptr, q_ptr, s_ptr, tq_ptr, ts_ptr, I, n_tiles, beta,
                                 linear_beta, BACKWARD: gl.constexpr, ROWS_STEP: gl.constexpr,
                                 COLS_STEP: gl.constexpr, num_warps: gl.constexpr):
    """Program (token tile t, column block cb of I) from G | U [P, 2I] (and dH [P, I]): the forward's H block --
    rows from the fp32 H (situ_quant's), token block from H rounded to G | U's dtype (the stored H's) -- or the
    backward's dG and dU blocks, rounded to that dtype for both (situ_backward_rows' rows: dG's block cb, dU's
    I / 128 + cb; token blocks: dG's channel c in row c of tq, dU's in I + c)."""
    act: gl.constexpr = gu_ptr.dtype.element_ty
    tile_b = _tile_buffer(act, ROWS_STEP)  # H's, or dU's
    if BACKWARD:
        tile_a = _tile_buffer(act, ROWS_STEP)  # dG's
        C = 2 * I
    else:
        tile_a = tile_b
        C = I
    t, cb, e, r0, r1 = _program_tile(tiles_ptr)
    if e >= 0:
        cols = cb * _QB + gl.arange(0, _QB, layout=gl.SliceLayout(0, _ROW_LAYOUT))
        for r in gl.static_range(0, _QB, ROWS_STEP):
            rows, rmask = _step_rows(r0, r, r1, ROWS_STEP)
            r64 = rows.to(gl.int64)
            gp = gu_ptr + r64[:, None] * (2 * I) + cols[None, :]
            g = gl.load(gp, mask=rmask[:, None], other=0.0).to(gl.float32)
            u = gl.load(gp + I, mask=rmask[:, None], other=0.0).to(gl.float32)
            if BACKWARD:
                dh = gl.load(dh_ptr + r64[:, None] * I + cols[None, :], mask=rmask[:, None], other=0.0)
                dg, du = situ_grads(dh.to(gl.float32), g, u, beta, linear_beta)
                dg = gl.where(rmask[:, None], dg, 0.0).to(act)
                du = gl.where(rmask[:, None], du, 0.0).to(act)
                store_row_quant(dg, rmask[:, None], rmask, r64, cols, cb, q_ptr, C, s_ptr, C // _QB)
                store_row_quant(du, rmask[:, None], rmask, r64, I + cols, I // _QB + cb, q_ptr, C, s_ptr, C // _QB)
                tile_a.slice(r, ROWS_STEP).store(dg)
                tile_b.slice(r, ROWS_STEP).store(du)
            else:
                h = gl.where(rmask[:, None], situ_h(g, u, beta, linear_beta), 0.0)
                store_row_quant(h, rmask[:, None], rmask, r64, cols, cb, q_ptr, C, s_ptr, C // _QB)
                tile_b.slice(r, ROWS_STEP).store(h.to(act))
        gl.thread_barrier()  # every row in shared memory before any column is read
        if BACKWARD:
            _token_blocks(tile_a, t, cb * _QB, tq_ptr, ts_ptr, C, n_tiles, COLS_STEP)
            _token_blocks(tile_b, t, I + cb * _QB, tq_ptr, ts_ptr, C, n_tiles, COLS_STEP)
        else:
            _token_blocks(tile_b, t, cb * _QB, tq_ptr, ts_ptr, C, n_tiles, COLS_STEP)


def _outputs(P: int, C: int, T: int, dev: torch.device):
    return ((torch.empty(P, C, device=dev, dtype=torch.float8_e4m3fn),
             torch.empty(P, C // QUANT_BLOCK, device=dev, dtype=torch.float32)),
            (torch.empty(C, T * QUANT_BLOCK, device=dev, dtype=torch.float8_e4m3fn),
             torch.empty(T, C, device=dev, dtype=torch.float32)))


def rows_and_token_blocks(P: int, C: int, args: tuple, consts: dict, tiles: torch.Tensor) -> RowsAndBlocks:
    """`fp8_grad.rows_and_token_blocks`' Gluon path: `args` / `consts` are `fp8_grad._source`'s (the rows' tensor
    or GatheredRows, checked there) -> ((q [P, C], s [P, C / 128]), (tq [C, T 128], ts [T, C]))."""
    T = tiles.shape[0]
    (q, s), (tq, ts) = out = _outputs(P, C, T, args[0].device)
    if P and T:
        _rows_and_blocks_kernel[(T, C // QUANT_BLOCK)](*args, tiles, q, s, tq, ts, C, T, **consts, ROWS_STEP=ROWS,
                                                       COLS_STEP=COLS, num_warps=WARPS)
    return out


def _situ(gu: torch.Tensor, dh: torch.Tensor | None, tiles: torch.Tensor, beta: float, linear_beta: float):
    P, I2 = gu.shape
    I = I2 // 2
    if I % QUANT_BLOCK or I2 != 2 * I or not gu.is_contiguous():
        raise ValueError(f"gu: expected contiguous [P, 2I] with I % {QUANT_BLOCK} == 0, got {tuple(gu.shape)}")
    if dh is not None and (dh.shape != (P, I) or not dh.is_contiguous() or dh.dtype != gu.dtype):
        raise ValueError(f"dh: expected contiguous [{P}, {I}] {gu.dtype}, got {tuple(dh.shape)} {dh.dtype}")
    T = tiles.shape[0]
    (q, s), (tq, ts) = out = _outputs(P, I2 if dh is not None else I, T, gu.device)
    if P and T:
        _situ_rows_and_blocks_kernel[(T, I // QUANT_BLOCK)](gu, gu if dh is None else dh, tiles, q, s, tq, ts, I, T,
                                                            float(beta), float(linear_beta), BACKWARD=dh is not None,
                                                            ROWS_STEP=SITU_ROWS, COLS_STEP=COLS, num_warps=WARPS)
    return out


def situ_rows_and_token_blocks(gu: torch.Tensor, tiles: torch.Tensor, beta: float, linear_beta: float) -> RowsAndBlocks:
    """H = SiTU(G) * cap(U) from G | U [P, 2I] -> (H's FP8 rows and scales, its token blocks and scales): the bits
    of `grouped_gemm.situ_quant`'s rows and of `fp8_grad.quantize_token_blocks` over the stored H, without H."""
    return _situ(gu, None, tiles, beta, linear_beta)


def situ_backward_rows_and_token_blocks(dh: torch.Tensor, gu: torch.Tensor, tiles: torch.Tensor, beta: float,
                                        linear_beta: float) -> RowsAndBlocks:
    """dG | dU of SiTU-and-mul from dH [P, I] and G | U [P, 2I] -> (their FP8 rows and scales, their token blocks
    and scales): the bits of `fp8_grad.situ_backward_rows`' rows and of `fp8_grad.quantize_token_blocks` over its
    dG | dU, without dG | dU."""
    return _situ(gu, dh, tiles, beta, linear_beta)
