"""Block-scaled FP8 grouped GEMM for Hopper in Gluon: C = A B_e^T over each expert's sorted rows, A in e4m3 with
1 x 128 scales along K, B_e in e4m3 with 128 x 128 block scales. The same product as the Triton kernel
(`grouped_gemm._segment_mm_kernel` with FP8=True, the CPU-tested path) and the same bits: each 128-wide K block is
one wgmma chain started from zero, its fp32 partial scaled as P * (s_a * s_b) and added to the accumulator in K
order.

Why a second kernel: Triton's `tl.dot` waits for each wgmma before its result can be scaled, and all warps run one
instruction stream, so the tensor cores idle while the CUDA cores scale (the FP8 forward ran slower than bf16;
kernels/moe/NOTES.md). Here the work is warp-specialised (DeepGEMM's layout of it): two consumer warpgroups each
own half of the tile's rows and run chain -> wait -> scale on their own, so one scales while the other's chain
runs; a one-warp producer fills a ring of `stages` shared-memory slots by TMA, each slot freed when both consumers'
chains have read it (mbarriers, no CTA-wide barrier in the loop). Keeping two partials in flight within one
warpgroup instead (wgmma of block k + 1 issued before block k is scaled) does not work: ptxas serialises every
wgmma when non-MMA instructions read one accumulator while another MMA is in flight (C7514, seen offline).

Gluon has no interpreter: this file runs only on sm_90 GPUs (`tests/kernels/test_moe_gluon.py` compares it bit for
bit with the Triton kernel there; on CPU the test compiles it ahead of time for sm_90a and checks the machine code).
`grouped_gemm.scaled_segment_mm` chooses it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from triton.experimental import gluon

from k3_kernels.moe.permute import program_tile
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                 warpgroup_mma_wait)

QUANT_BLOCK = 128  # the K block of both operands' scales and of one wgmma chain
_SCALE_N = gl.constexpr(QUANT_BLOCK)  # columns under one weight scale (kernels take globals only as constexpr)
# 12 warps (4 + 4 + the producer's group) x 32 threads x 168 <= 65,536 registers; setmaxnreg then moves them
_MAXNREG = 168


def check_consumer_regs(regs: int) -> None:
    """Registers a consumer thread gets by setmaxnreg (both Gluon tiles): a multiple of 8 with 2 x regs + 40 (two
    consumer warpgroups and the producer's group) <= 512."""
    if regs % 8 or not 24 <= regs or 2 * regs + 40 > 512:
        raise ValueError(f"tile: consumer_regs must be a multiple of 8 in [24, 236], got {regs}")


@dataclass(frozen=True)
class GluonTile:
    """Launch settings: block_m rows (two consumer warpgroups of block_m / 2 = 64 rows), block_n = 128 output
    columns (one weight-scale block), block_k = 128 (one scale block), `stages` TMA slots, registers a consumer
    thread gets (setmaxnreg; the producer warp's group gets 40; 3 groups of 128 threads share 64K registers),
    whether the grid is persistent (one program an SM, each walking tiles pid, pid + programs, ...: its producer
    loads the next tile while the consumers scale and store the last) or one program a tile, whether the
    consumers load the next K block's scales before this block's chain, and whether the wgrad stores its tiles
    by TMA from shared memory (16 or 32 KB a consumer); the wgrad's rows a tile and ring depth."""
    block_m: int = 128
    stages: int = 2  # with 256-column tiles: the H100 sweep's and layer rows' choice (kernels/moe/NOTES.md)
    consumer_regs: int = 232
    group_m: int = 8
    persistent: bool = True  # the H200 A/B's choice (the same sweep)
    # measured no faster (NOTES.md, session 35); reaches 128-column mm tiles and 128-row wgrad tiles (256-row
    # ones measured slower with it: session 43)
    prefetch_scales: bool = False
    tma_store_wgrad: bool = True  # the wgrad's tiles out by TMA from shared memory (that sweep's choice)
    block_n: int = QUANT_BLOCK
    block_k: int = QUANT_BLOCK
    # output columns of a forward / dgrad tile: 128 (one weight-scale block) or 256 (two, scaled one after the
    # other through one partial; the wgrad keeps block_n); same bits either way
    mm_block_n: int = 2 * QUANT_BLOCK  # (the H100 sweep: +10-25% on the four GEMMs; NOTES.md, session 40)
    # the gate/up as one launch with SiTU and H's FP8 rows in its epilogue (gluon_gate_up.py: a tile's halves are
    # G and U of the same 128 columns), instead of the G | U launch and `grouped_gemm.situ_quant`'s pass
    fuse_situ: bool = False
    # rows of a wgrad tile: 128 (a consumer's 64 rows, one 64 x 128 chain a K block) or 256 (a consumer's 128
    # rows as four 64 x 64 chains a K block; `_consume_tall_tile`); same bits either way
    wgrad_block_m: int = 2 * QUANT_BLOCK  # (the H100 sweep's choice; NOTES.md, session 41)
    wgrad_stages: int = 3  # the wgrads' ring (the forward / dgrad GEMMs' is `stages`; same sweep)
    # 256-row wgrad tiles: each row half's A block loaded into registers once a K block and used by both column
    # halves' chains (wgmma with A from registers: 16 KB of shared-memory operand reads a consumer and K block
    # fewer); same bits
    wgrad_a_in_registers: bool = False

    def validate(self) -> None:
        if self.block_n != QUANT_BLOCK or self.block_k != QUANT_BLOCK:
            raise ValueError(f"tile: block_n and block_k must be {QUANT_BLOCK} (one scale block)")
        if self.mm_block_n not in (QUANT_BLOCK, 2 * QUANT_BLOCK):
            raise ValueError(f"tile: mm_block_n must be {QUANT_BLOCK} or {2 * QUANT_BLOCK}, got {self.mm_block_n}")
        if self.wgrad_block_m not in (QUANT_BLOCK, 2 * QUANT_BLOCK):
            raise ValueError(f"tile: wgrad_block_m must be {QUANT_BLOCK} or {2 * QUANT_BLOCK}, got "
                             f"{self.wgrad_block_m}")
        if self.block_m != 128:
            raise ValueError(f"tile: block_m must be 128 (64 rows a consumer warpgroup), got {self.block_m}")
        if not 2 <= self.stages <= 6 or not 2 <= self.wgrad_stages <= 6:
            raise ValueError(f"tile: stages and wgrad_stages must lie in [2, 6], got {self.stages}, "
                             f"{self.wgrad_stages}")
        check_consumer_regs(self.consumer_regs)


DEFAULT_TILE = GluonTile()


def usable(k: int, n: int) -> bool:
    """Shapes this kernel takes: whole scale blocks along K and N (K3: K = 3072, 3584, 6144; N = 3584, 6144,
    7168); the caller falls back to the Triton kernel otherwise."""
    return k % QUANT_BLOCK == 0 and n % QUANT_BLOCK == 0 and k > 0


@gluon.jit
def _ring(a_desc, b_desc, STAGES: gl.constexpr):
    """The operand ring for a_desc's and b_desc's boxes (`_ring_of`)."""
    return _ring_of(a_desc.dtype, a_desc.block_type.shape[0], a_desc.block_type.shape[1],
                    gl.constexpr(a_desc.layout), b_desc.dtype, b_desc.block_type.shape[0], b_desc.block_type.shape[1],
                    gl.constexpr(b_desc.layout), STAGES)


@gluon.jit
def _ring_of(a_dtype: gl.constexpr, A0: gl.constexpr, A1: gl.constexpr, a_layout: gl.constexpr,
             b_dtype: gl.constexpr, B0: gl.constexpr, B1: gl.constexpr, b_layout: gl.constexpr, STAGES: gl.constexpr):
    """The operand ring: STAGES slots of A's two row halves (an [A0, A1] box each) and B's tile ([B0, B1]), a
    `ready` barrier a slot (the producer's TMA bytes) and an `empty` one (one arrival per consumer warpgroup)."""
    a_lo = gl.allocate_shared_memory(a_dtype, [STAGES, A0, A1], a_layout)
    a_hi = gl.allocate_shared_memory(a_dtype, [STAGES, A0, A1], a_layout)
    b_bufs = gl.allocate_shared_memory(b_dtype, [STAGES, B0, B1], b_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    fence_async_shared()  # the inits visible to the async proxy (TMA) before its first completion (CUTLASS does)
    return a_lo, a_hi, b_bufs, ready, empty


@gluon.jit
def _load_blocks(a_desc, b_desc, b2_desc, ready, empty, a_lo, a_hi, b_bufs, r0, off_b, second, kb0, n_k, it,
                 STAGES: gl.constexpr, BLOCK_K: gl.constexpr, HALF_M: gl.constexpr, SPLIT_B: gl.constexpr):
    """The producer's share of one tile: TMA loads of K blocks kb0 .. kb0 + n_k - 1 (both row halves of A, the B
    tile from the first or `second` B; SPLIT_B: B's box into the slot's first rows and B2's into the rest) into
    the ring's next free slots. `it` counts the ring's fills over the program's earlier tiles (slot and barrier
    phase); returns the count after this tile."""
    for k in range(n_k):
        i = it + k
        kc = (kb0 + k) * BLOCK_K
        slot = i % STAGES
        mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1 at once
        bar = ready.index(slot)
        n_b: gl.constexpr = 2 if SPLIT_B else 1
        mbarrier.expect(bar, 2 * a_desc.block_type.nbytes + n_b * b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [r0, kc], bar, a_lo.index(slot))
        tma.async_copy_global_to_shared(a_desc, [r0 + HALF_M, kc], bar, a_hi.index(slot))
        if SPLIT_B:
            rows: gl.constexpr = b_desc.block_type.shape[0]
            tma.async_copy_global_to_shared(b_desc, [off_b, kc], bar, b_bufs.index(slot).slice(0, rows))
            tma.async_copy_global_to_shared(b2_desc, [off_b, kc], bar, b_bufs.index(slot).slice(rows, rows))
        else:
            tma.async_copy_global_to_shared(b_desc, [off_b, kc], bar, b_bufs.index(slot), not second)
            tma.async_copy_global_to_shared(b2_desc, [off_b, kc], bar, b_bufs.index(slot), second)
    return it + n_k


@gluon.jit
def _mm_tile(t, tiles_ptr, n_tiles_m, N, N_B, K, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
             GROUP_M: gl.constexpr):
    """Tile t of the grouped GEMM (`program_tile`'s order) -> (expert (-1: none), first row, the expert's end row,
    first column, from the second B?, column within its B, row of B's view [E * N_B, K], K blocks)."""
    e, r0, r1, tn = program_tile(t, tiles_ptr, n_tiles_m, gl.cdiv(N, BLOCK_N), GROUP_M)
    col0 = tn * BLOCK_N
    second = col0 >= N_B
    local = col0 - gl.where(second, N_B, 0)
    return e, r0, r1, col0, second, local, e * N_B + local, K // BLOCK_K


@gluon.jit
def _mm_producer(a_desc, b_desc, b2_desc, ready, empty, a_lo, a_hi, b_bufs, tiles_ptr, n_tiles_m, N, N_B, K,
                 BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                 HALF_M: gl.constexpr, SPLIT_B: gl.constexpr):
    """One warp: the loads of every tile this program owns (tiles pid, pid + programs, ...), running ahead into the
    next tile while the consumers finish the last one. SPLIT_B: `_load_blocks`' (B's and B2's boxes of the same
    columns in one slot: gluon_gate_up.py)."""
    it = 0
    for t in range(gl.program_id(0), n_tiles_m * gl.cdiv(N, BLOCK_N), gl.num_programs(0)):
        e, r0, r1, col0, second, local, off_b, n_k = _mm_tile(t, tiles_ptr, n_tiles_m, N, N_B, K, BLOCK_N, BLOCK_K,
                                                               GROUP_M)
        if e >= 0:
            it = _load_blocks(a_desc, b_desc, b2_desc, ready, empty, a_lo, a_hi, b_bufs, r0, off_b, second, 0, n_k,
                              it, STAGES, BLOCK_K, HALF_M, SPLIT_B)


@gluon.jit
def _consume_tile(a_bufs, b_bufs, ready, empty, sa_ptrs, rmask, sb_ptr, sb_mask, it, n_k, sb_step, sa_step,
                  HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SCALES_PER_COL: gl.constexpr,
                  PREFETCH_SCALES: gl.constexpr):
    """One warpgroup's rows of one tile. Per K block: wgmma chain from zero, wait, free the slot, then
    acc + P * (s_a * s_b) on the CUDA cores (s_a * s_b once a row: one FMA an element) -- while the other
    warpgroup's chain runs on the tensor cores. s_a is one scale a row (sa_ptrs + k * sa_step), s_b one scalar
    (sb_ptr + k) or, SCALES_PER_COL (the wgrad), one a column (sb_ptr + k * sb_step, sb_mask), applied as
    acc + (P * s_a) * s_b. PREFETCH_SCALES loads block k + 1's scales before block k's chain (their latency off
    the scaling's path; more registers, same bits)."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    acc = gl.zeros((HALF_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
    part = gl.zeros((HALF_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
    if PREFETCH_SCALES:
        has_k = n_k > 0  # (an expert without tokens: its scale row may lie past the end)
        sa_next = gl.load(sa_ptrs, mask=rmask & has_k, other=0.0)
        if SCALES_PER_COL:
            sb_next = gl.load(sb_ptr, mask=sb_mask & has_k, other=0.0)
        else:
            sb_next = gl.load(sb_ptr, mask=has_k, other=0.0)
    for k in range(n_k):
        i = it + k
        slot = i % STAGES
        if PREFETCH_SCALES:
            sa = sa_next
            sb = sb_next
            k_next = gl.minimum(k + 1, n_k - 1)  # the last block loads its own scales again (in bounds)
            sa_next = gl.load(sa_ptrs + k_next * sa_step, mask=rmask, other=0.0)
            if SCALES_PER_COL:
                sb_next = gl.load(sb_ptr + k_next * sb_step, mask=sb_mask, other=0.0)
            else:
                sb_next = gl.load(sb_ptr + k_next)
        else:
            sa = gl.load(sa_ptrs + k * sa_step, mask=rmask, other=0.0)
            if SCALES_PER_COL:
                sb = gl.load(sb_ptr + k * sb_step, mask=sb_mask, other=0.0)
            else:
                sb = gl.load(sb_ptr + k)
        if not SCALES_PER_COL:
            row_scale = sa * sb  # one multiply a row, then one FMA an element
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        part = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), part, use_acc=False,
                             is_async=True)
        part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
        mbarrier.arrive(empty.index(slot), count=1)
        if SCALES_PER_COL:
            acc = acc + part * sa[:, None] * sb[None, :]
        else:
            acc = acc + part * row_scale[:, None]
        # a wait with nothing in flight, taking acc: the scaling cannot sink past the next wgmma's issue (which
        # would keep both partials live and make ptxas serialise the MMAs)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    return acc


@gluon.jit
def _consume_wide_tile(a_bufs, b_bufs, ready, empty, sa_ptrs, rmask, sb_ptr, sb_hi_ptr, it, n_k,
                       HALF_M: gl.constexpr, STAGES: gl.constexpr):
    """`_consume_tile` (one scale a row and one a K block) for a tile of two weight-scale blocks (256 columns:
    each A block read from L2 once for both halves): per K block the low half's chain and scaling, then the high
    half's through the same partial -- the 128-column tile's arithmetic for each half, so the same bits, in
    2 x 64 + 64 accumulator registers a thread instead of 2 x 128. sb_ptr / sb_hi_ptr: the halves' scales (one
    a K block). (The wgrad's per-column scales on top of these spill: 256-column wgrad tiles ran slower, NOTES.md
    session 40.)"""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, _SCALE_N, 32])
    acc_lo = gl.zeros((HALF_M, _SCALE_N), dtype=gl.float32, layout=mma_layout)
    acc_hi = gl.zeros((HALF_M, _SCALE_N), dtype=gl.float32, layout=mma_layout)
    part = gl.zeros((HALF_M, _SCALE_N), dtype=gl.float32, layout=mma_layout)
    for k in range(n_k):
        i = it + k
        slot = i % STAGES
        sa = gl.load(sa_ptrs + k, mask=rmask, other=0.0)
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        b_tile = b_bufs.index(slot)
        for half in gl.static_range(2):
            part = warpgroup_mma(a_bufs.index(slot), b_tile.slice(half * _SCALE_N, _SCALE_N).permute((1, 0)), part,
                                 use_acc=False, is_async=True)
            row_scale = sa * gl.load((sb_ptr if half == 0 else sb_hi_ptr) + k)
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
            if half == 1:
                mbarrier.arrive(empty.index(slot), count=1)
            scaled = part * row_scale[:, None]
            # (the trailing wait, as in `_consume_tile`: the scaling stays before the next chain's issue)
            if half == 0:
                acc_lo = warpgroup_mma_wait(num_outstanding=0, deps=(acc_lo + scaled,))
            else:
                acc_hi = warpgroup_mma_wait(num_outstanding=0, deps=(acc_hi + scaled,))
    return acc_lo, acc_hi


@gluon.jit
def _add_to_quarter(acc00, acc01, acc10, acc11, scaled, r: gl.constexpr, c: gl.constexpr):
    """Quarter (r, c) of `_consume_tall_tile`'s accumulators plus a scaled partial. The trailing wait, as in
    `_consume_tile`: the scaling stays before the next chain's issue."""
    if r == 0 and c == 0:
        acc00 = warpgroup_mma_wait(num_outstanding=0, deps=(acc00 + scaled,))
    elif r == 0:
        acc01 = warpgroup_mma_wait(num_outstanding=0, deps=(acc01 + scaled,))
    elif c == 0:
        acc10 = warpgroup_mma_wait(num_outstanding=0, deps=(acc10 + scaled,))
    else:
        acc11 = warpgroup_mma_wait(num_outstanding=0, deps=(acc11 + scaled,))
    return acc00, acc01, acc10, acc11


@gluon.jit
def _consume_tall_tile(a_bufs, b_bufs, ready, empty, sa_ptrs, sb_ptrs, it, n_k, sb_step, sa_step,
                       STAGES: gl.constexpr, A_IN_REGS: gl.constexpr):
    """The wgrad's `_consume_tile` for a consumer owning 128 rows of a 256 x 128 tile (each operand block read
    from L2 for twice the MMAs of a 128 x 128 tile): per K block four 64 x 64 chains -- column half c's scales
    loaded once, then its low and high rows' chains -- each scaled as acc + (P * s_a) * s_b into its own quarter
    accumulator, so every output element gets the 128 x 128 tile's arithmetic and bits. 64-column chains keep
    4 x 32 + 32 accumulator registers and 16 column scales live (64 x 128 chains with 128 columns' scales spill:
    NOTES.md, session 41). sa_ptrs: the low rows' scale pointers (the high rows' are 64 further), sb_ptrs: the low
    columns' (the high columns' are 64 further); no masks (the wgrad's tiles are whole)."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, 64, 32])
    acc00 = gl.zeros((64, 64), dtype=gl.float32, layout=mma_layout)
    acc01 = gl.zeros((64, 64), dtype=gl.float32, layout=mma_layout)
    acc10 = gl.zeros((64, 64), dtype=gl.float32, layout=mma_layout)
    acc11 = gl.zeros((64, 64), dtype=gl.float32, layout=mma_layout)
    part = gl.zeros((64, 64), dtype=gl.float32, layout=mma_layout)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=4)
    for k in range(n_k):
        i = it + k
        slot = i % STAGES
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        a_tile = a_bufs.index(slot)
        if A_IN_REGS:  # each row half's operand read from shared memory once, for both column halves' chains
            for r in gl.static_range(2):
                a_regs = a_tile.slice(r * 64, 64).load(a_layout)
                sa = gl.load(sa_ptrs + k * sa_step + r * 64)
                for c in gl.static_range(2):
                    b_half = b_bufs.index(slot).slice(c * 64, 64).permute((1, 0))
                    sb = gl.load(sb_ptrs + k * sb_step + c * 64)
                    part = warpgroup_mma(a_regs, b_half, part, use_acc=False, is_async=True)
                    part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
                    if c == 1 and r == 1:
                        mbarrier.arrive(empty.index(slot), count=1)
                    acc00, acc01, acc10, acc11 = _add_to_quarter(acc00, acc01, acc10, acc11,
                                                                 part * sa[:, None] * sb[None, :], r, c)
        else:
            for c in gl.static_range(2):
                b_half = b_bufs.index(slot).slice(c * 64, 64).permute((1, 0))
                sb = gl.load(sb_ptrs + k * sb_step + c * 64)
                for r in gl.static_range(2):
                    part = warpgroup_mma(a_tile.slice(r * 64, 64), b_half, part, use_acc=False, is_async=True)
                    sa = gl.load(sa_ptrs + k * sa_step + r * 64)
                    part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
                    if c == 1 and r == 1:
                        mbarrier.arrive(empty.index(slot), count=1)
                    acc00, acc01, acc10, acc11 = _add_to_quarter(acc00, acc01, acc10, acc11,
                                                                 part * sa[:, None] * sb[None, :], r, c)
    return acc00, acc01, acc10, acc11


@gluon.jit
def _store_tile(c_ptr, acc, rows, rmask, col0, N, c_stride):
    """One consumer's [64, 128] of an output tile from its registers."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, _SCALE_N, 32])
    cols = col0 + gl.arange(0, _SCALE_N, layout=gl.SliceLayout(0, mma_layout))
    ptrs = c_ptr + rows.to(gl.int64)[:, None] * c_stride + cols[None, :]
    gl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=rmask[:, None] & (cols < N)[None, :])


@gluon.jit
def _mm_consumer(a_bufs, b_bufs, ready, empty, as_ptr, bs_ptr, bs2_ptr, c_ptr, tiles_ptr, n_tiles_m, N, N_B, K,
                 c_stride, ROW_OFFSET: gl.constexpr, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, PREFETCH_SCALES: gl.constexpr):
    """One warpgroup: rows [r0 + ROW_OFFSET, + HALF_M) of every tile this program owns; stores each tile.
    BLOCK_N: one weight-scale block (128) or two (`_consume_wide_tile`)."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, _SCALE_N, 32])
    it = 0
    for t in range(gl.program_id(0), n_tiles_m * gl.cdiv(N, BLOCK_N), gl.num_programs(0)):
        e, r0, r1, col0, second, local, off_b, n_k = _mm_tile(t, tiles_ptr, n_tiles_m, N, N_B, K, BLOCK_N, BLOCK_K,
                                                               GROUP_M)
        if e >= 0:
            sb_base = (e.to(gl.int64) * gl.cdiv(N_B, _SCALE_N) + local // _SCALE_N) * n_k
            sb_ptr = gl.where(second, bs2_ptr, bs_ptr) + sb_base
            rows = r0 + ROW_OFFSET + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, mma_layout))
            rmask = rows < r1
            if BLOCK_N == _SCALE_N:
                acc = _consume_tile(a_bufs, b_bufs, ready, empty, as_ptr + rows.to(gl.int64) * n_k, rmask, sb_ptr,
                                    None, it, n_k, 0, 1, HALF_M, BLOCK_N, STAGES, False, PREFETCH_SCALES)
                _store_tile(c_ptr, acc, rows, rmask, col0, N, c_stride)
            else:
                acc_lo, acc_hi = _consume_wide_tile(a_bufs, b_bufs, ready, empty, as_ptr + rows.to(gl.int64) * n_k,
                                                    rmask, sb_ptr, sb_ptr + n_k, it, n_k, HALF_M, STAGES)
                _store_tile(c_ptr, acc_lo, rows, rmask, col0, N, c_stride)
                _store_tile(c_ptr, acc_hi, rows, rmask, col0 + _SCALE_N, N, c_stride)
            it += n_k


@gluon.jit
def _scaled_mm_kernel(a_desc, b_desc, b2_desc, as_ptr, bs_ptr, bs2_ptr, c_ptr, tiles_ptr, n_tiles_m, N, N_B, K,
                      c_stride,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                      STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PREFETCH_SCALES: gl.constexpr,
                      num_warps: gl.constexpr):
    """Warp-specialised: this partition (4 warps) and a worker partition (4 warps) each own half of a tile's
    rows; a 1-warp worker issues the TMA loads. Slots are freed when both halves' chains have read them.
    Output columns [0, N_B) come from B (b_desc, bs_ptr), [N_B, N) from B2 (gate/up: W1 then W3, one launch).
    A program owns tiles pid, pid + programs, ... (one tile a program when the grid covers them all; the
    persistent grid, one program an SM, lets the producer load the next tile during the last one's epilogue)."""
    HALF_M: gl.constexpr = BLOCK_M // 2
    a_lo, a_hi, b_bufs, ready, empty = _ring(a_desc, b_desc, STAGES)
    gl.warp_specialize([
        (_mm_consumer, (a_lo, b_bufs, ready, empty, as_ptr, bs_ptr, bs2_ptr, c_ptr, tiles_ptr, n_tiles_m, N, N_B, K,
                        c_stride, 0, HALF_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, PREFETCH_SCALES)),
        (_mm_consumer, (a_hi, b_bufs, ready, empty, as_ptr, bs_ptr, bs2_ptr, c_ptr, tiles_ptr, n_tiles_m, N, N_B, K,
                        c_stride, HALF_M, HALF_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, PREFETCH_SCALES)),
        (_mm_producer, (a_desc, b_desc, b2_desc, ready, empty, a_lo, a_hi, b_bufs, tiles_ptr, n_tiles_m, N, N_B, K,
                        BLOCK_N, BLOCK_K, GROUP_M, STAGES, HALF_M, False)),
    ], [4, 1], [CONSUMER_REGS, 40])


@gluon.jit
def _wgrad_tile(t, tile_off_ptr, M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Wgrad tile t (expert-major, then row tiles, then column tiles) -> (expert, first row, first column, the
    expert's first token block, its blocks)."""
    n_tn = gl.cdiv(N, BLOCK_N)
    per_expert = (M // BLOCK_M) * n_tn
    e = t // per_expert
    tm = (t % per_expert) // n_tn
    tn = t % n_tn
    t0 = gl.load(tile_off_ptr + e).to(gl.int32)
    n_k = gl.load(tile_off_ptr + e + 1).to(gl.int32) - t0
    return e.to(gl.int64), tm * BLOCK_M, tn * BLOCK_N, t0, n_k


@gluon.jit
def _wgrad_producer(a_desc, b_desc, ready, empty, a_lo, a_hi, b_bufs, tile_off_ptr, M, N, n_tiles,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    it = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        e, m0, col0, t0, n_k = _wgrad_tile(t, tile_off_ptr, M, N, BLOCK_M, BLOCK_N)
        it = _load_blocks(a_desc, b_desc, b_desc, ready, empty, a_lo, a_hi, b_bufs, m0, col0, False, t0, n_k, it,
                          STAGES, BLOCK_K, BLOCK_M // 2, False)


@gluon.jit
def _wgrad_consumer(a_bufs, b_bufs, ready, empty, as_ptr, bs_ptr, out_ptr, out2_ptr, out_desc, out2_desc, c_buf,
                    tile_off_ptr, M, N, M_SPLIT, n_tiles, ROW_OFFSET: gl.constexpr, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PREFETCH_SCALES: gl.constexpr,
                    TMA_STORE: gl.constexpr, A_IN_REGS: gl.constexpr):
    """One warpgroup of the wgrad: rows [m0 + ROW_OFFSET, + BLOCK_M / 2) of A for every tile the program owns
    (one 64-row chain a K block, or two when BLOCK_M is 256: `_consume_tall_tile`); per token block t the partial
    is scaled by s_a[t, m] and s_b[t, n] (both per row of their operand: 128 tokens x 1 blocks; scales are
    [T, channels], so a block's scales are one contiguous row)."""
    OWN_M: gl.constexpr = BLOCK_M // 2
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    it = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        e, m0, col0, t0, n_k = _wgrad_tile(t, tile_off_ptr, M, N, BLOCK_M, BLOCK_N)
        t64 = t0.to(gl.int64)
        if OWN_M == 64:
            rows = m0 + ROW_OFFSET + gl.arange(0, OWN_M, layout=gl.SliceLayout(1, mma_layout))
            cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
            acc = _consume_tile(a_bufs, b_bufs, ready, empty, as_ptr + t64 * M + rows, rows < M,
                                bs_ptr + t64 * N + cols, cols < N, it, n_k, N, M, OWN_M, BLOCK_N, STAGES, True,
                                PREFETCH_SCALES)
            _wgrad_store(acc, c_buf, out_ptr, out2_ptr, out_desc, out2_desc, e, m0, col0, rows, cols, M, N,
                         M_SPLIT, ROW_OFFSET, TMA_STORE)
        else:
            q_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, 64, 32])
            q_rows = m0 + ROW_OFFSET + gl.arange(0, 64, layout=gl.SliceLayout(1, q_layout))
            q_cols = col0 + gl.arange(0, 64, layout=gl.SliceLayout(0, q_layout))
            quarters = _consume_tall_tile(a_bufs, b_bufs, ready, empty, as_ptr + t64 * M + q_rows,
                                          bs_ptr + t64 * N + q_cols, it, n_k, N, M, STAGES, A_IN_REGS)
            if TMA_STORE:  # the four quarters into c_buf, then one TMA store of the consumer's 128 rows
                tma.store_wait(0)
                for q in gl.static_range(4):
                    c_buf.slice((q // 2) * 64, 64).slice((q % 2) * 64, 64, dim=1).store(
                        quarters[q].to(out_desc.dtype))
                fence_async_shared()
                _wgrad_tma_store(c_buf, out_desc, out2_desc, e, m0, col0, M, M_SPLIT, ROW_OFFSET)
            else:
                for q in gl.static_range(4):
                    _wgrad_store(quarters[q], c_buf, out_ptr, out2_ptr, out_desc, out2_desc, e, m0, col0,
                                 q_rows + (q // 2) * 64, q_cols + (q % 2) * 64, M, N, M_SPLIT, ROW_OFFSET, False)
        it += n_k
    if TMA_STORE:
        tma.store_wait(0)


@gluon.jit
def _wgrad_tma_store(c_buf, out_desc, out2_desc, e, m0, col0, M, M_SPLIT, ROW_OFFSET: gl.constexpr):
    """The TMA store of c_buf (a consumer's rows of an output tile, written to shared memory and fenced)."""
    second = m0 >= M_SPLIT
    out_rows = gl.where(second, M - M_SPLIT, M_SPLIT)
    row = (e * out_rows + m0 + ROW_OFFSET - gl.where(second, M_SPLIT, 0)).to(gl.int32)
    if second:
        tma.async_copy_shared_to_global(out2_desc, [row, col0], c_buf)
    else:
        tma.async_copy_shared_to_global(out_desc, [row, col0], c_buf)


@gluon.jit
def _wgrad_store(acc, c_buf, out_ptr, out2_ptr, out_desc, out2_desc, e, m0, col0, rows, cols, M, N, M_SPLIT,
                 ROW_OFFSET: gl.constexpr, TMA_STORE: gl.constexpr):
    """One consumer's half of an output tile: TMA_STORE through c_buf (shared memory) by a TMA store that
    drains while the next chains run (its rows are whole: no mask), else each thread stores its registers."""
    if TMA_STORE:
        tma.store_wait(0)  # the last store has read c_buf
        c_buf.store(acc.to(out_desc.dtype))
        fence_async_shared()
        _wgrad_tma_store(c_buf, out_desc, out2_desc, e, m0, col0, M, M_SPLIT, ROW_OFFSET)
    else:
        second = m0 >= M_SPLIT
        out_rows = gl.where(second, M - M_SPLIT, M_SPLIT)
        base = gl.where(second, out2_ptr, out_ptr) + e * out_rows * N
        local = rows - gl.where(second, M_SPLIT, 0)
        gl.store(base + local.to(gl.int64)[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty))


@gluon.jit
def _scaled_wgrad_kernel(a_desc, b_desc, as_ptr, bs_ptr, out_ptr, out2_ptr, out_desc, out2_desc, tile_off_ptr, M, N,
                         M_SPLIT, n_tiles, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                         STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PREFETCH_SCALES: gl.constexpr,
                         TMA_STORE: gl.constexpr, A_IN_REGS: gl.constexpr, num_warps: gl.constexpr):
    """out[e] tile (tm, tn) = sum over expert e's token blocks (fp8_grad._wgrad_kernel's product, same order):
    the forward kernel's partitions with K running over the expert's blocks and both scales per row; tiles
    expert-major, a program owning tiles pid, pid + programs, ... as the forward kernel's."""
    HALF_M: gl.constexpr = BLOCK_M // 2
    a_lo, a_hi, b_bufs, ready, empty = _ring(a_desc, b_desc, STAGES)
    if TMA_STORE:  # one output half-tile buffer a consumer
        c_lo = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape, out_desc.layout)
        c_hi = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape, out_desc.layout)
    else:
        c_lo = a_lo
        c_hi = a_hi
    gl.warp_specialize([
        (_wgrad_consumer, (a_lo, b_bufs, ready, empty, as_ptr, bs_ptr, out_ptr, out2_ptr, out_desc, out2_desc, c_lo,
                           tile_off_ptr, M, N, M_SPLIT, n_tiles, 0, BLOCK_M, BLOCK_N, STAGES, PREFETCH_SCALES,
                           TMA_STORE, A_IN_REGS)),
        (_wgrad_consumer, (a_hi, b_bufs, ready, empty, as_ptr, bs_ptr, out_ptr, out2_ptr, out_desc, out2_desc, c_hi,
                           tile_off_ptr, M, N, M_SPLIT, n_tiles, HALF_M, BLOCK_M, BLOCK_N, STAGES, PREFETCH_SCALES,
                           TMA_STORE, A_IN_REGS)),
        (_wgrad_producer, (a_desc, b_desc, ready, empty, a_lo, a_hi, b_bufs, tile_off_ptr, M, N, n_tiles, BLOCK_M,
                           BLOCK_N, BLOCK_K, STAGES)),
    ], [4, 1], [CONSUMER_REGS, 40])


def _programs(n_tiles: int, tile: GluonTile, device: torch.device) -> int:
    """Grid size: every tile its own program, or (persistent) one program an SM."""
    if not tile.persistent:
        return n_tiles
    return max(1, min(n_tiles, torch.cuda.get_device_properties(device).multi_processor_count))


_GL_DTYPES = {torch.float8_e4m3fn: gl.float8e4nv, torch.bfloat16: gl.bfloat16, torch.float16: gl.float16,
              torch.float32: gl.float32}


def _descriptor(t: torch.Tensor, block: list[int]):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    layout = gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPES[t.dtype])
    return TensorDescriptor.from_tensor(t, block, layout)


def scaled_segment_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                      tiles: torch.Tensor, out: torch.Tensor, b2: tuple[torch.Tensor, torch.Tensor] | None = None,
                      tile: GluonTile = DEFAULT_TILE) -> torch.Tensor:
    """out[r] = sum_kb (A[r, kb] B_e[:, kb]^T * a_scale[r, kb]) * b_scale[e, :, kb] over each tile's rows; with
    b2 = (B2, B2 scales) the output columns are B's then B2's (gate/up: out = G | U from W1, W3).

    a [P, K] e4m3, a_scale [P, K / 128] fp32, b (and B2) [E, N_B, K] e4m3, b_scale [E, N_B / 128, K / 128] fp32,
    tiles = RoutingPlan.tiles(tile.block_m), out [P, N_B or 2 N_B] (any float dtype, contiguous columns)."""
    tile.validate()
    P, K = a.shape
    E, N_B, Kb = b.shape
    if Kb != K or not usable(K, N_B):
        raise ValueError(f"b: expected [E, N, {K}] with N and K multiples of {QUANT_BLOCK}, got {tuple(b.shape)}")
    scales = (P, K // QUANT_BLOCK), (E, N_B // QUANT_BLOCK, K // QUANT_BLOCK)
    if a_scale.shape != scales[0] or b_scale.shape != scales[1]:
        raise ValueError(f"a_scale / b_scale: expected {scales[0]} / {scales[1]}, got {tuple(a_scale.shape)} / "
                         f"{tuple(b_scale.shape)}")
    b2_q, b2_scale = b2 if b2 is not None else (b, b_scale)
    if b2_q.shape != b.shape or b2_scale.shape != b_scale.shape:
        raise ValueError(f"b2: expected {tuple(b.shape)} / {tuple(b_scale.shape)}, got {tuple(b2_q.shape)} / "
                         f"{tuple(b2_scale.shape)}")
    N = N_B * (2 if b2 is not None else 1)
    if out.shape != (P, N) or out.stride(1) != 1:
        raise ValueError(f"out: expected [{P}, {N}] with contiguous columns, got {tuple(out.shape)}")
    for name, t in (("a", a), ("a_scale", a_scale), ("b", b), ("b_scale", b_scale), ("b2", b2_q),
                    ("b2 scales", b2_scale)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: must be contiguous")
    if P == 0:
        return out
    block_n = tile.mm_block_n if N_B % tile.mm_block_n == 0 else QUANT_BLOCK  # (a tile never straddles B and B2)
    a_desc = _descriptor(a, [tile.block_m // 2, tile.block_k])
    b_desc = _descriptor(b.view(E * N_B, K), [block_n, tile.block_k])
    b2_desc = _descriptor(b2_q.view(E * N_B, K), [block_n, tile.block_k])
    n_m = tiles.shape[0]
    grid = (_programs(n_m * (N // block_n), tile, a.device),)
    _scaled_mm_kernel[grid](a_desc, b_desc, b2_desc, a_scale, b_scale, b2_scale, out, tiles, n_m, N, N_B, K,
                            out.stride(0), BLOCK_M=tile.block_m, BLOCK_N=block_n, BLOCK_K=tile.block_k,
                            GROUP_M=tile.group_m, STAGES=tile.stages, CONSUMER_REGS=tile.consumer_regs,
                            PREFETCH_SCALES=tile.prefetch_scales, num_warps=4, maxnreg=_MAXNREG)
    return out


def scaled_wgrad(aq: torch.Tensor, a_scale: torch.Tensor, bq: torch.Tensor, b_scale: torch.Tensor,
                 tile_offsets: torch.Tensor, out: torch.Tensor, out2: torch.Tensor, split: int,
                 tile: GluonTile = DEFAULT_TILE) -> None:
    """fp8_grad.wgrad_fp8's product (checked there): aq [M, T 128], bq [N, T 128] token-block-quantised, scales
    [T, M] / [T, N]; rows [0, split) of each expert's [M, N] gradient into out [E, split, N], the rest into out2."""
    tile.validate()
    M, N = aq.shape[0], bq.shape[0]
    E = out.shape[0]
    if M % tile.block_m or N % tile.block_n or split % tile.block_m:
        raise ValueError(f"aq, bq: rows must be multiples of {tile.block_m} / {tile.block_n} (split {split}), got "
                         f"{M}, {N}")
    tall = M % tile.wgrad_block_m == 0 and split % tile.wgrad_block_m == 0
    block_m = tile.wgrad_block_m if tall else tile.block_m  # (a tile never straddles out and out2)
    for name, t in (("aq", aq), ("a_scale", a_scale), ("bq", bq), ("b_scale", b_scale), ("out", out), ("out2", out2)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: must be contiguous")
    a_desc = _descriptor(aq, [block_m // 2, tile.block_k])
    b_desc = _descriptor(bq, [tile.block_n, tile.block_k])
    box = [block_m // 2, tile.block_n]  # the TMA store's: one consumer's half of an output tile
    out_desc = _descriptor(out.view(-1, N), box)
    out2_desc = _descriptor(out2.view(-1, N), box) if out2.numel() else out_desc
    n_tiles = E * (M // block_m) * (N // tile.block_n)
    _scaled_wgrad_kernel[(_programs(n_tiles, tile, aq.device),)](
        a_desc, b_desc, a_scale, b_scale, out, out2, out_desc, out2_desc, tile_offsets, M, N, split, n_tiles,
        BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, STAGES=tile.wgrad_stages,
        CONSUMER_REGS=tile.consumer_regs, PREFETCH_SCALES=tile.prefetch_scales, TMA_STORE=tile.tma_store_wgrad,
        A_IN_REGS=tile.wgrad_a_in_registers, num_warps=4, maxnreg=_MAXNREG)
