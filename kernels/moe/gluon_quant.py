"""Both FP8 quantisations of expert-sorted rows in one pass on sm_90 (Gluon): the 1 x 128 rows a GEMM reads along
K and the 128-token blocks a wgrad reads -- `fp8_grad.quantize_rows` and `fp8_grad.quantize_token_blocks` (the
CPU-tested Triton passes, the spec of this kernel) in one kernel with their bits, the rows read once.

Why: FP8_FULL needs both forms of the permuted tokens X (the gate/up's rows, dW1 | dW3's token blocks) and of
dY (the down dgrad's rows, dW2's token blocks). Both are gathered in place (`GatheredRows`: a token's row read for
each of its k slots, mostly from L2), so the two Triton passes are bound by their writes and their programs'
latency rather than by HBM reads; one pass writes the same bytes and reads once. A Triton program cannot hold a
token tile for the second quantisation without ~128 x 128 values in registers (kernels/moe/NOTES.md, sessions 31
and 41); here the tile waits in shared memory.

A program owns one token tile (an expert's rows r0 .. r1 <= r0 + 128: `fp8_grad.token_block_tiles`) and one
128-column block. First sweep, ROWS rows at a time in a row-major layout (a thread 8 adjacent columns): load,
quantise each row (scale = amax / 448), store its e4m3 values and scale, and keep the rows (rounded as loaded,
zeros past the expert) in shared memory. Second sweep, COLS columns at a time in a column-major layout (a warp 32
adjacent tokens of one column): each column's scale over the tile's 128 tokens, its e4m3 values stored
transposed into the tile's token block. Shared memory is swizzled in 4-byte units by the row (32 phases), so the
second sweep's column reads spread over the banks.

Gluon has no interpreter: this runs only on sm_90 (tests/kernels/test_moe_fp8_grad.py compares it with the
Triton passes bit for bit there; on CPU the build test compiles it for sm_90a). Opt-in: `fp8_grad.ONE_PASS_QUANT`.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from k3_kernels.moe.permute import FP8_MAX, QUANT_BLOCK

_QB = gl.constexpr(QUANT_BLOCK)
_E4M3_MAX = gl.constexpr(FP8_MAX)
# rows a step of the first sweep, columns a step of the second, warps: a program's size, not its bits
ROWS, COLS, WARPS = 32, 32, 4


@gluon.jit
def _scale(amax):
    """e4m3 scale of a block whose largest magnitude is amax (permute.e4m3_scale's arithmetic)."""
    return gl.where(amax > 0, gl.div_rn(amax, _E4M3_MAX), 1.0)


@gluon.jit
def _values(v, scale):
    """v / scale clamped to e4m3's range (permute.e4m3_values' arithmetic; minimum / maximum are the clamp)."""
    return gl.minimum(gl.maximum(gl.div_rn(v, scale), -_E4M3_MAX), _E4M3_MAX)


@gluon.jit
def _load_rows(x_ptr, x_stride, order_ptr, w_ptr, top_k, rows, rmask, cols, GATHER: gl.constexpr,
               HAS_W: gl.constexpr, ROUND: gl.constexpr):
    """permute.load_rows: rows x cols of x, or of the GatheredRows it describes (x[order[r] // top_k], HAS_W: times
    weights[order[r]] in fp32 and rounded to ROUND); zeros where not rmask."""
    if GATHER:
        pair = gl.load(order_ptr + rows, mask=rmask, other=0)
        src = (pair // top_k).to(gl.int64)
        v = gl.load(x_ptr + src[:, None] * x_stride + cols[None, :], mask=rmask[:, None], other=0.0)
        if HAS_W:
            wr = gl.load(w_ptr + pair, mask=rmask, other=0.0)
            v = (v.to(gl.float32) * wr[:, None]).to(ROUND)
    else:
        v = gl.load(x_ptr + rows.to(gl.int64)[:, None] * x_stride + cols[None, :], mask=rmask[:, None], other=0.0)
    return v


@gluon.jit
def _rows_and_blocks_kernel(x_ptr, x_stride, order_ptr, w_ptr, top_k, tiles_ptr, q_ptr, s_ptr, tq_ptr, ts_ptr, C,
                            n_tiles, GATHER: gl.constexpr, HAS_W: gl.constexpr, ROUND: gl.constexpr,
                            ROWS_STEP: gl.constexpr, COLS_STEP: gl.constexpr, num_warps: gl.constexpr):
    row_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    col_layout: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [1, num_warps], [0, 1])
    dt: gl.constexpr = ROUND if HAS_W else x_ptr.dtype.element_ty
    vec: gl.constexpr = 32 // dt.primitive_bitwidth  # elements in 4 bytes: the swizzle's unit
    tile = gl.allocate_shared_memory(dt, [_QB, _QB], gl.SwizzledSharedLayout(vec, 1, 32, [1, 0]))
    t = gl.program_id(0)
    cb = gl.program_id(1)
    e = gl.load(tiles_ptr + t * 3)
    if e >= 0:
        r0 = gl.load(tiles_ptr + t * 3 + 1)
        r1 = gl.load(tiles_ptr + t * 3 + 2)
        cols = cb * _QB + gl.arange(0, _QB, layout=gl.SliceLayout(0, row_layout))
        for r in gl.static_range(0, _QB, ROWS_STEP):
            rows = r0 + r + gl.arange(0, ROWS_STEP, layout=gl.SliceLayout(1, row_layout))
            rmask = rows < r1
            v = _load_rows(x_ptr, x_stride, order_ptr, w_ptr, top_k, rows, rmask, cols, GATHER, HAS_W, ROUND)
            v32 = gl.where(rmask[:, None], v.to(gl.float32), 0.0)
            scale = _scale(gl.max(gl.abs(v32), axis=1))
            r64 = rows.to(gl.int64)
            gl.store(q_ptr + r64[:, None] * C + cols[None, :], _values(v32, scale[:, None]).to(q_ptr.dtype.element_ty),
                     mask=rmask[:, None])
            gl.store(s_ptr + r64 * (C // _QB) + cb, scale, mask=rmask)
            tile.slice(r, ROWS_STEP).store(v)
        gl.thread_barrier()  # every row in shared memory before any column is read
        slots = t * _QB + gl.arange(0, _QB, layout=gl.SliceLayout(1, col_layout))
        for c in gl.static_range(0, _QB, COLS_STEP):
            vt = tile.slice(c, COLS_STEP, dim=1).load(col_layout).to(gl.float32)
            ccols = cb * _QB + c + gl.arange(0, COLS_STEP, layout=gl.SliceLayout(0, col_layout))
            scale = _scale(gl.max(gl.abs(vt), axis=0))
            gl.store(tq_ptr + ccols.to(gl.int64)[None, :] * (n_tiles * _QB) + slots[:, None],
                     _values(vt, scale[None, :]).to(tq_ptr.dtype.element_ty))
            gl.store(ts_ptr + t.to(gl.int64) * C + ccols, scale)


def rows_and_token_blocks(P: int, C: int, args: tuple, consts: dict, tiles: torch.Tensor
                          ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """`fp8_grad.rows_and_token_blocks`' Gluon path: `args` / `consts` are `fp8_grad._source`'s (the rows' tensor
    or GatheredRows, checked there) -> ((q [P, C], s [P, C / 128]), (tq [C, T 128], ts [T, C]))."""
    dev = args[0].device
    T = tiles.shape[0]
    q = torch.empty(P, C, device=dev, dtype=torch.float8_e4m3fn)
    s = torch.empty(P, C // QUANT_BLOCK, device=dev, dtype=torch.float32)
    tq = torch.empty(C, T * QUANT_BLOCK, device=dev, dtype=torch.float8_e4m3fn)
    ts = torch.empty(T, C, device=dev, dtype=torch.float32)
    if P and T:
        _rows_and_blocks_kernel[(T, C // QUANT_BLOCK)](*args, tiles, q, s, tq, ts, C, T, **consts, ROWS_STEP=ROWS,
                                                       COLS_STEP=COLS, num_warps=WARPS)
    return (q, s), (tq, ts)
