"""Grouped bf16 GEMMs for Hopper in Gluon (warp-specialised): C = A B_e^T over each expert's sorted rows, for the
forward (B_e = W_e stored [N, K]: K contiguous) and the dgrads (B_e[n, k] = W_e[k, n]: N contiguous), with an
optional second B for the columns past N_B (gate/up: G | U from W1, W3) or the K past K_B (gate/up dgrad:
[dG | dU] against W1, then W3); and the weight gradient D_e^T X_e (`wgrad`: K over the expert's rows, through
TMA descriptors made on the device per expert, which end at its last row so the next expert's rows read as zeros).

The same product as the Triton kernels (grouped_gemm._gate_up_kernel / _segment_mm_kernel in bf16): one fp32
accumulator per output element, K in order in 16-wide wgmma steps, the first without the (zero) accumulator --
so the Triton kernels' bits are expected (the GPU tests assert it). Layout as gluon_gemm.py: two consumer
warpgroups of 64 rows each (a 128 x 256 tile, 128 accumulator registers a thread), a one-warp TMA producer over a
ring of `stages` slots; here the wgmma chains stay in flight across K steps (`warpgroup_mma_wait(1)`: a slot is
released once the chain after it has been issued), nothing but the MMAs touching the accumulator in the loop.

Gluon has no interpreter: sm_90 GPUs only; `grouped_gemm` calls it inside `gemm_kernels(GemmKernels.GLUON)`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from k3_kernels.moe.gluon_gemm import _MAXNREG, _ring, _ring_of, check_consumer_regs
from k3_kernels.moe.permute import program_tile


class BLayout(enum.Enum):
    K_CONTIGUOUS = "k"   # B_e is [N, K] with K contiguous (the forward's weights: W1, W3 [E, I, L], W2 [E, L, I])
    N_CONTIGUOUS = "n"   # B_e[n, k] = W_e[k, n], W_e [K, N] (the dgrads: dH = dY W2_e, dX = dG W1_e + dU W3_e)


@dataclass(frozen=True)
class Bf16Tile:
    """block_m rows (two consumer warpgroups of 64), block_n columns, block_k K a step, `stages` ring slots
    (48 KB each at 128 x 256 x 64), registers a consumer thread gets."""
    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    stages: int = 4
    consumer_regs: int = 232
    group_m: int = 8

    def validate(self) -> None:
        if self.block_m != 128 or self.block_n not in (128, 256) or self.block_k != 64:
            raise ValueError(f"tile: expected block_m 128, block_n 128 or 256, block_k 64, got {self}")
        if not 2 <= self.stages <= 4:
            raise ValueError(f"tile: stages must lie in [2, 4], got {self.stages}")
        check_consumer_regs(self.consumer_regs)


DEFAULT_TILE = Bf16Tile()


def usable(k: int, n: int, tile: Bf16Tile = DEFAULT_TILE) -> bool:
    """Whole tiles along K and N (K3: K = 3072, 3584, 6144; N = 3072, 3584, 6144)."""
    return k > 0 and k % tile.block_k == 0 and n % tile.block_n == 0


@gluon.jit
def _producer(a_desc, b_desc, b2_desc, ready, empty, a_lo, a_hi, b_bufs, r0, e, col0, N_B, K_B, n_k,
              B_K_MAJOR: gl.constexpr, STAGES: gl.constexpr, BLOCK_K: gl.constexpr, HALF_M: gl.constexpr):
    """One warp: the TMA loads of each K step into the next free slot. K-major B: tile [BN, BK] of B viewed
    [E N_B, K], the second B for tiles at or past column N_B. N-contiguous B: tile [BK, BN] of B viewed [E K_B, N],
    the second B for K at or past K_B."""
    n_second = col0 >= N_B
    n_local = col0 - gl.where(n_second, N_B, 0)
    for k in range(n_k):
        slot = k % STAGES
        mbarrier.wait(empty.index(slot), ((k // STAGES) & 1) ^ 1)
        bar = ready.index(slot)
        mbarrier.expect(bar, 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        kc = k * BLOCK_K
        tma.async_copy_global_to_shared(a_desc, [r0, kc], bar, a_lo.index(slot))
        tma.async_copy_global_to_shared(a_desc, [r0 + HALF_M, kc], bar, a_hi.index(slot))
        if B_K_MAJOR:
            row = e * N_B + n_local
            tma.async_copy_global_to_shared(b_desc, [row, kc], bar, b_bufs.index(slot), not n_second)
            tma.async_copy_global_to_shared(b2_desc, [row, kc], bar, b_bufs.index(slot), n_second)
        else:
            k_second = kc >= K_B
            row = e * K_B + kc - gl.where(k_second, K_B, 0)
            tma.async_copy_global_to_shared(b_desc, [row, col0], bar, b_bufs.index(slot), not k_second)
            tma.async_copy_global_to_shared(b2_desc, [row, col0], bar, b_bufs.index(slot), k_second)


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, c_ptr, r0, r1, col0, N, n_k, c_stride, A_M_MAJOR: gl.constexpr,
              B_K_MAJOR: gl.constexpr, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One warpgroup: output rows [r0, r0 + HALF_M) of the tile (those below r1 stored), its chains in flight across
    K steps. A_M_MAJOR: A's box is [K, M] (the wgrad's D), used through its permuted view (wgmma takes M-contiguous
    A for 16-bit types); B_K_MAJOR: B's box is [N, K], likewise."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    acc = gl.zeros((HALF_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
    for k in range(n_k):
        slot = k % STAGES
        mbarrier.wait(ready.index(slot), (k // STAGES) & 1)
        if A_M_MAJOR:
            a = a_bufs.index(slot).permute((1, 0))
        else:
            a = a_bufs.index(slot)
        if B_K_MAJOR:
            b = b_bufs.index(slot).permute((1, 0))
        else:
            b = b_bufs.index(slot)
        acc = warpgroup_mma(a, b, acc, use_acc=k > 0, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        mbarrier.arrive(empty.index((k + STAGES - 1) % STAGES), count=1, pred=k > 0)  # step k - 1's slot
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    rows = r0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, mma_layout))
    cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
    ptrs = c_ptr + rows.to(gl.int64)[:, None] * c_stride + cols[None, :]
    gl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows < r1)[:, None] & (cols < N)[None, :])


@gluon.jit
def _bf16_mm_kernel(a_desc, b_desc, b2_desc, c_ptr, tiles_ptr, n_tiles_m, N, N_B, K, K_B, c_stride,
                    B_K_MAJOR: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                    GROUP_M: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                    num_warps: gl.constexpr):
    HALF_M: gl.constexpr = BLOCK_M // 2
    e, r0, r1, tn = program_tile(gl.program_id(0), tiles_ptr, n_tiles_m, gl.cdiv(N, BLOCK_N), GROUP_M)
    if e >= 0:
        a_lo, a_hi, b_bufs, ready, empty = _ring(a_desc, b_desc, STAGES)
        n_k = K // BLOCK_K
        col0 = tn * BLOCK_N
        gl.warp_specialize([
            (_consumer, (a_lo, b_bufs, ready, empty, c_ptr, r0, r1, col0, N, n_k, c_stride, False, B_K_MAJOR,
                         HALF_M, BLOCK_N, STAGES)),
            (_consumer, (a_hi, b_bufs, ready, empty, c_ptr, r0 + HALF_M, r1, col0, N, n_k, c_stride, False,
                         B_K_MAJOR, HALF_M, BLOCK_N, STAGES)),
            (_producer, (a_desc, b_desc, b2_desc, ready, empty, a_lo, a_hi, b_bufs, r0, e, col0, N_B, K_B, n_k,
                         B_K_MAJOR, STAGES, BLOCK_K, HALF_M)),
        ], [4, 1], [CONSUMER_REGS, 40])


@gluon.jit
def _wgrad_producer(d_ptr, x_ptr, M, N, d_stride, x_stride, ready, empty, a_lo, a_hi, b_bufs, r0, r1, m0, col0, n_k,
                    STAGES: gl.constexpr, BLOCK_K: gl.constexpr, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """One warp: K step k is rows [r0 + k BLOCK_K, ..) of D (two [BLOCK_K, HALF_M] boxes at columns m0, m0 + HALF_M)
    and of X (a [BLOCK_K, BLOCK_N] box at column col0), through descriptors made here (the warp that issues the
    copies also acquires them) that end at the expert's last row r1: the next expert's rows read as zeros."""
    rows = gl.maximum(r1, 1)  # (an expert without rows loads nothing; its descriptor still needs a valid extent)
    a_desc = tma.make_tensor_descriptor(d_ptr, [rows, M], [d_stride, 1], [BLOCK_K, HALF_M], a_lo.type.layout)
    b_desc = tma.make_tensor_descriptor(x_ptr, [rows, N], [x_stride, 1], [BLOCK_K, BLOCK_N], b_bufs.type.layout)
    for k in range(n_k):
        slot = k % STAGES
        mbarrier.wait(empty.index(slot), ((k // STAGES) & 1) ^ 1)
        bar = ready.index(slot)
        mbarrier.expect(bar, 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        row = r0 + k * BLOCK_K
        tma.async_copy_global_to_shared(a_desc, [row, m0], bar, a_lo.index(slot))
        tma.async_copy_global_to_shared(a_desc, [row, m0 + HALF_M], bar, a_hi.index(slot))
        tma.async_copy_global_to_shared(b_desc, [row, col0], bar, b_bufs.index(slot))


@gluon.jit
def _bf16_wgrad_kernel(d_ptr, x_ptr, out_ptr, out2_ptr, offsets_ptr, M, N, M_SPLIT, d_stride, x_stride,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                       CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """out[e] = D_e^T X_e over expert e's rows (D [P, M], X [P, N]); rows m >= M_SPLIT of it into out2. One program
    per (expert, output tile), the expert's rows in order: grouped_gemm._wgrad_kernel's sum."""
    HALF_M: gl.constexpr = BLOCK_M // 2
    e = gl.program_id(1).to(gl.int64)
    n_tn = gl.cdiv(N, BLOCK_N)
    m0 = (gl.program_id(0) // n_tn) * BLOCK_M
    col0 = (gl.program_id(0) % n_tn) * BLOCK_N
    r0 = gl.load(offsets_ptr + e).to(gl.int32)
    r1 = gl.load(offsets_ptr + e + 1).to(gl.int32)
    n_k = gl.cdiv(r1 - r0, BLOCK_K)
    second = m0 >= M_SPLIT
    out_rows = gl.where(second, M - M_SPLIT, M_SPLIT)
    base = gl.where(second, out2_ptr, out_ptr) + e * out_rows * N
    local = m0 - gl.where(second, M_SPLIT, 0)
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, HALF_M], gl.bfloat16)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], gl.bfloat16)
    a_lo, a_hi, b_bufs, ready, empty = _ring_of(gl.bfloat16, BLOCK_K, HALF_M, a_layout, gl.bfloat16, BLOCK_K,
                                                BLOCK_N, b_layout, STAGES)
    gl.warp_specialize([
        (_consumer, (a_lo, b_bufs, ready, empty, base, local, out_rows, col0, N, n_k, N, True, False, HALF_M,
                     BLOCK_N, STAGES)),
        (_consumer, (a_hi, b_bufs, ready, empty, base, local + HALF_M, out_rows, col0, N, n_k, N, True, False,
                     HALF_M, BLOCK_N, STAGES)),
        (_wgrad_producer, (d_ptr, x_ptr, M, N, d_stride, x_stride, ready, empty, a_lo, a_hi, b_bufs, r0, r1, m0,
                           col0, n_k, STAGES, BLOCK_K, HALF_M, BLOCK_N)),
    ], [4, 1], [CONSUMER_REGS, 40])


def _descriptor_workspace() -> None:
    """Device-side TMA descriptors need a global workspace from Triton's runtime allocator: give it torch's caching
    allocator unless the caller has set one."""
    import triton
    from triton.runtime import _allocation
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, device="cuda", dtype=torch.int8))


def wgrad(d: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, n_experts: int, out_dtype: torch.dtype,
          split: int | None = None, tile: Bf16Tile = DEFAULT_TILE) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """out[e] = D_e^T X_e over expert e's rows offsets[e] .. offsets[e + 1] (D [P, M], X [P, N], bf16, rows may be
    strided, columns contiguous) -> [E, M, N]; with `split`, rows [0, split) and [split, M) as two tensors."""
    tile.validate()
    P, M = d.shape
    N = x.shape[1]
    s = M if split is None else split
    for name, t in (("d", d), ("x", x)):
        if t.dtype != torch.bfloat16 or t.stride(1) != 1 or (t.stride(0) * 2) % 16:
            raise ValueError(f"{name}: expected bf16 rows with contiguous columns and 16-byte aligned rows")
    if M % tile.block_m or N % tile.block_n or s % tile.block_m or x.shape[0] != P:
        raise ValueError(f"d, x: expected [P, M], [P, N] with M, split multiples of {tile.block_m} and N of "
                         f"{tile.block_n}, got {tuple(d.shape)}, {tuple(x.shape)}, split {split}")
    out = torch.empty(n_experts, s, N, device=d.device, dtype=out_dtype)
    out2 = torch.empty(n_experts, M - s, N, device=d.device, dtype=out_dtype) if split is not None else out
    if n_experts == 0:
        return out if split is None else (out, out2)
    _descriptor_workspace()
    grid = ((M // tile.block_m) * (N // tile.block_n), n_experts)
    _bf16_wgrad_kernel[grid](d, x, out, out2, offsets, M, N, s, d.stride(0), x.stride(0), BLOCK_M=tile.block_m,
                             BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, STAGES=tile.stages,
                             CONSUMER_REGS=tile.consumer_regs, num_warps=4, maxnreg=_MAXNREG)
    return out if split is None else (out, out2)


def _descriptor(t: torch.Tensor, block: list[int]):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))


def segment_mm(a: torch.Tensor, b: torch.Tensor, tiles: torch.Tensor, out: torch.Tensor, layout: BLayout,
               b2: torch.Tensor | None = None, tile: Bf16Tile = DEFAULT_TILE) -> torch.Tensor:
    """out = A B_e^T over each tile's rows (tiles = RoutingPlan.tiles(tile.block_m)), bf16 in, fp32 accumulation.

    K_CONTIGUOUS: b [E, N_B, K]; with b2 the output is [P, 2 N_B], b's columns then b2's.
    N_CONTIGUOUS: b [E, K_B, N] (B_e[n, k] = b[e, k, n]); with b2, K = 2 K_B: A's first K_B columns against b,
    the rest against b2."""
    tile.validate()
    if not isinstance(layout, BLayout):
        raise ValueError(f"layout: expected a BLayout, got {layout!r}")
    P, K = a.shape
    E = b.shape[0]
    for name, t in (("a", a), ("b", b), ("b2", b2 if b2 is not None else b)):
        if t.dtype != torch.bfloat16 or not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous bf16 tensor, got {t.dtype}")
    if b2 is not None and b2.shape != b.shape:
        raise ValueError(f"b2: expected {tuple(b.shape)}, got {tuple(b2.shape)}")
    halves = 2 if b2 is not None else 1
    if layout is BLayout.K_CONTIGUOUS:
        N_B, K_B, N = b.shape[1], K, b.shape[1] * halves
        ok = b.shape[2] == K
    else:
        K_B, N, N_B = b.shape[1], b.shape[2], b.shape[2]
        ok = K_B * halves == K
    if not ok or not usable(K, N_B, tile) or (layout is BLayout.N_CONTIGUOUS and K_B % tile.block_k):
        raise ValueError(f"b: shape {tuple(b.shape)} does not fit a [{P}, {K}] A in {layout.name} tiles of "
                         f"{tile.block_n} x {tile.block_k}")
    if out.shape != (P, N) or out.stride(1) != 1:
        raise ValueError(f"out: expected [{P}, {N}] with contiguous columns, got {tuple(out.shape)}")
    if P == 0:
        return out
    a_desc = _descriptor(a, [tile.block_m // 2, tile.block_k])
    box = [tile.block_n, tile.block_k] if layout is BLayout.K_CONTIGUOUS else [tile.block_k, tile.block_n]
    rows_b = E * (N_B if layout is BLayout.K_CONTIGUOUS else K_B)
    b_desc = _descriptor(b.view(rows_b, -1), box)
    b2_desc = _descriptor((b2 if b2 is not None else b).view(rows_b, -1), box)
    n_m = tiles.shape[0]
    grid = (n_m * (N // tile.block_n),)
    _bf16_mm_kernel[grid](a_desc, b_desc, b2_desc, out, tiles, n_m, N, N_B, K, K_B, out.stride(0),
                          B_K_MAJOR=layout is BLayout.K_CONTIGUOUS, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
                          BLOCK_K=tile.block_k, GROUP_M=tile.group_m, STAGES=tile.stages,
                          CONSUMER_REGS=tile.consumer_regs, num_warps=4, maxnreg=_MAXNREG)
    return out
