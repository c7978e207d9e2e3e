"""Permutation of (token, slot) pairs into expert order and the combine back (Triton), deterministic.

`plan_routing` sorts the pairs by expert with a stable sort (within an expert by pair id = t k + j), so each
permuted row's place depends only on the routing, and counts the experts' rows and builds the grouped GEMMs' tile
table on the device (no host sync). `permute_rows` gathers rows (optionally quantising them to FP8 e4m3 with
1 x 128 scales in the same pass) into new tensors or into caller-given buffers at a row offset (the staging the EP
dispatch of issue #29 uses).
`combine` sums a token's k rows in slot order in fp32 (no atomics, no scatter-add); `combine_backward` gives the
rows' gradients and the gate weights' gradients. `GatheredRows` / `load_rows`: permuted rows (or combine's dY)
read in place by the FP8 quantisers instead of written out. Spec: naive.py (naive_permutation, naive_permute,
naive_combine).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from k3_kernels.launch import cdiv, next_pow2
from k3_kernels.moe.naive import AMAX_FLOOR, FP8_MAX, QUANT_BLOCK

# what the kernels read (globals in a kernel must be constexpr); the values are the spec's
_E4M3_MAX = tl.constexpr(FP8_MAX)
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)


@triton.jit
def e4m3_scales(amax):
    """(scale, inverse) of a block whose largest magnitude is amax: scale = amax / 448 (what dequantisation
    multiplies by), inverse = 448 / amax (what quantisation multiplies by: one IEEE division a block, not one an
    element), both with amax floored at 448 * 2^-126; (1, 1) for an all-zero block. Every FP8 quantiser of the
    MoE kernels; spec naive._scales."""
    floored = tl.maximum(amax, _AMAX_FLOOR)
    scale = tl.where(amax > 0, tl.math.div_rn(floored, _E4M3_MAX), 1.0)
    inverse = tl.where(amax > 0, tl.math.div_rn(_E4M3_MAX, floored), 1.0)
    return scale, inverse


@triton.jit
def e4m3_values(v, inverse):
    """v * inverse (round to nearest) clamped to e4m3's range; the cast to float8e4nv rounds to nearest."""
    return tl.clamp(v * inverse, -_E4M3_MAX, _E4M3_MAX)


def row_pass_grid(rows: int, block_rows: int, col_blocks: int) -> tuple[int]:
    """The one-dimensional grid of a row pass (`row_pass_program` maps its program ids)."""
    return (cdiv(rows, block_rows) * col_blocks,)


@triton.jit
def row_pass_program(pid, n_col_blocks):
    """(row block, column block) of program pid of a row pass over a one-dimensional grid, the column blocks of a
    row block consecutive: programs launched together read neighbouring bytes of the same rows and write their
    scales into the same sectors (row blocks fastest left both strided by a whole row)."""
    return pid // n_col_blocks, pid % n_col_blocks


@triton.jit
def store_row_quant(v, mask, rmask, r64, cols, block, q_ptr, q_stride, s_ptr, s_stride):
    """v [rows, 128] quantised 1 x 128 a row (entries outside `mask` count as zeros): e4m3 values into q[r, cols]
    (rows q_stride apart) where `mask`, each row's scale into s[r, block] (rows s_stride apart) where `rmask`.
    Every FP8 row quantiser of the layer goes through it (the permute's X, H in the gate/up epilogue and the SiTU
    pass, the backward's dY and dG | dU)."""
    v = tl.where(mask, v.to(tl.float32), 0.0)
    scale, inverse = e4m3_scales(tl.max(tl.abs(v), axis=1))
    q = e4m3_values(v, inverse[:, None])
    tl.store(q_ptr + r64[:, None] * q_stride + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + r64 * s_stride + block, scale, mask=rmask)


@dataclass(frozen=True)
class GatheredRows:
    """Permuted rows read in place instead of materialised: row r is x[order[r] // top_k], times weights[order[r]]
    and rounded to `dtype` when weights are given -- the permuted tokens (weights None; `permute_rows`'s bf16
    rows) or combine's row gradients dY (dout and the gate weights; `combine_backward`'s dy), same bits.
    x [N, D] with contiguous rows, order = RoutingPlan.order, weights fp32 [N * top_k] (contiguous)."""
    x: torch.Tensor
    order: torch.Tensor
    top_k: int
    weights: torch.Tensor | None = None
    dtype: torch.dtype | None = None  # the rounding of a weighted row (default x's dtype)

    @property
    def rows(self) -> int:
        return self.order.numel()

    def kernel_args(self) -> tuple:
        """(x, x row stride, order, weights or x, top_k) and the constexprs (GATHER, HAS_W, ROUND) for `load_rows`."""
        w = self.weights if self.weights is not None else self.x
        return (self.x, self.x.stride(0), self.order, w, self.top_k), dict(
            GATHER=True, HAS_W=self.weights is not None, ROUND=_TL_DTYPES[self.dtype or self.x.dtype])

    def check(self, name: str) -> None:
        if self.x.dim() != 2 or self.x.stride(1) != 1:
            raise ValueError(f"{name}: expected [N, D] with contiguous rows, got {tuple(self.x.shape)}")
        if self.weights is not None and (self.weights.dtype != torch.float32 or not self.weights.is_contiguous()
                                         or self.weights.numel() != self.x.shape[0] * self.top_k):
            raise ValueError(f"{name}: weights must be contiguous fp32 [N * top_k], got {tuple(self.weights.shape)} "
                             f"{self.weights.dtype}")


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def load_rows(x_ptr, x_stride, order_ptr, w_ptr, top_k, rows, rmask, cols, mask, GATHER: tl.constexpr,
              HAS_W: tl.constexpr, ROUND: tl.constexpr):
    """Rows `rows` x columns `cols` (zeros outside `mask`) of x, or with GATHER of the `GatheredRows` it
    describes: x[order[r] // top_k] (HAS_W: * weights[order[r]] in fp32, rounded to ROUND)."""
    if GATHER:
        pair = tl.load(order_ptr + rows, mask=rmask, other=0)
        src = (pair // top_k).to(tl.int64)
        v = tl.load(x_ptr + src[:, None] * x_stride + cols[None, :], mask=mask, other=0.0)
        if HAS_W:
            wr = tl.load(w_ptr + pair, mask=rmask, other=0.0)
            v = (v.to(tl.float32) * wr[:, None]).to(ROUND)
    else:
        v = tl.load(x_ptr + rows.to(tl.int64)[:, None] * x_stride + cols[None, :], mask=mask, other=0.0)
    return v


@triton.jit
def program_tile(pid, tiles_ptr, n_tiles_m, n_tiles_n, GROUP_M: tl.constexpr):
    """Program pid of a grouped GEMM over `RoutingPlan.tiles` -> (expert, first row, expert's end row, n tile),
    swizzled: GROUP_M m-tiles share the n sweep, so their weight tiles stay in L2."""
    per_group = GROUP_M * n_tiles_n
    g = pid // per_group
    first_m = g * GROUP_M
    size_m = tl.minimum(n_tiles_m - first_m, GROUP_M)
    tm = first_m + (pid % per_group) % size_m
    tn = (pid % per_group) // size_m
    e = tl.load(tiles_ptr + tm * 3)
    r0 = tl.load(tiles_ptr + tm * 3 + 1)
    r1 = tl.load(tiles_ptr + tm * 3 + 2)
    return e, r0, r1, tn


@dataclass(frozen=True)
class RoutingPlan:
    """Where every (token, slot) pair goes. order [P]: pair id of each permuted row; pos [N, k]: the permuted row
    of each pair; offsets [E + 1] (int64): expert e's rows; counts [E]."""
    order: torch.Tensor
    pos: torch.Tensor
    offsets: torch.Tensor
    counts: torch.Tensor
    n_experts: int
    top_k: int

    @property
    def rows(self) -> int:
        return self.order.numel()

    def tiles(self, block_m: int) -> torch.Tensor:
        """Tile table for the grouped GEMMs: int32 [T, 3] rows (expert, first row, end row of the expert), one per
        block_m rows of each expert; T = cdiv(P, block_m) + E is a host-side bound, unused tiles have expert -1."""
        E = self.n_experts
        per = (self.counts + block_m - 1) // block_m
        end = torch.cumsum(per, 0)
        T = cdiv(max(self.rows, 1), block_m) + E
        t = torch.arange(T, device=self.counts.device)
        e = torch.searchsorted(end, t, right=True)
        valid = e < E
        ec = e.clamp(max=E - 1)
        local = t - (end[ec] - per[ec])
        first = self.offsets[ec] + local * block_m
        return torch.stack([torch.where(valid, ec, -1), first, self.offsets[ec + 1]], 1).to(torch.int32).contiguous()


def plan_routing(idx: torch.Tensor, n_experts: int) -> RoutingPlan:
    """idx [N, k] expert ids (any int dtype) -> RoutingPlan. Raises on ids outside [0, n_experts)."""
    if idx.dim() != 2:
        raise ValueError(f"idx: expected [N, k], got shape {tuple(idx.shape)}")
    flat = idx.reshape(-1).long()
    if flat.numel() and not idx.is_cuda and (int(flat.min()) < 0 or int(flat.max()) >= n_experts):
        raise ValueError(f"idx: expert ids must lie in [0, {n_experts}), got [{int(flat.min())}, {int(flat.max())}]")
    order = torch.sort(flat, stable=True).indices
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=idx.device)
    # integer scatter-add (exact in any order): torch.bincount sizes its output from the ids' maximum, read on the
    # host -- a device sync in every MoE layer of every forward. Ids outside [0, E) (unchecked callers on CUDA) land
    # in a spare bin that is dropped, as bincount's [:E] dropped ids >= E, instead of a device-side assert.
    binned = torch.where((flat >= 0) & (flat < n_experts), flat, n_experts)
    counts = torch.zeros(n_experts + 1, dtype=torch.long, device=idx.device).scatter_add_(
        0, binned, torch.ones_like(binned))[:n_experts]
    offsets = torch.zeros(n_experts + 1, dtype=torch.long, device=idx.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return RoutingPlan(order, pos.view(idx.shape), offsets, counts, n_experts, idx.shape[1])


@triton.jit
def _permute_kernel(x_ptr, src_ptr, out_ptr, q_ptr, s_ptr, P, D, x_stride, out_stride, q_stride, top_k,
                    WRITE_OUT: tl.constexpr, QUANT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    rmask = rows < P
    src = (tl.load(src_ptr + rows, mask=rmask, other=0) // top_k).to(tl.int64)
    r64 = rows.to(tl.int64)
    n_blocks = tl.cdiv(D, BLOCK_D)
    for b in range(0, n_blocks):
        cols = b * BLOCK_D + tl.arange(0, BLOCK_D)
        m = rmask[:, None] & (cols < D)[None, :]
        v = tl.load(x_ptr + src[:, None] * x_stride + cols[None, :], mask=m, other=0.0)
        if WRITE_OUT:
            tl.store(out_ptr + r64[:, None] * out_stride + cols[None, :], v, mask=m)
        if QUANT:  # BLOCK_D == 128: one scale per row per block
            store_row_quant(v, m, rmask, r64, cols, b, q_ptr, q_stride, s_ptr, n_blocks)


def permute_rows(x: torch.Tensor, plan: RoutingPlan, *, bf16: bool = True, fp8: bool = False,
                 out: torch.Tensor | None = None, out_q: torch.Tensor | None = None,
                 out_scale: torch.Tensor | None = None, row_offset: int = 0
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Permuted rows x[order // k] -> (rows [P, D] in x.dtype | None, fp8 rows [P, D] | None, scales fp32
    [P, D / 128] | None). Given buffers (`out` [>= row_offset + P, D], `out_q`, `out_scale` alike) are written at
    rows row_offset.. and returned as those row views: a dispatch buffer is filled in place, nothing else is
    allocated. FP8 needs D % 128 == 0."""
    P, D = plan.rows, x.shape[1]
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x: expected a [N, D] tensor with contiguous rows, got shape {tuple(x.shape)}")
    if fp8 and D % QUANT_BLOCK:
        raise ValueError(f"x: FP8 rows need a width divisible by {QUANT_BLOCK}, got {D}")

    def _buf(given, name, width, dtype):
        if given is None:
            return torch.empty(P, width, device=x.device, dtype=dtype)
        if given.shape[0] < row_offset + P or given.shape[1] != width or given.dtype != dtype or given.stride(1) != 1:
            raise ValueError(f"{name}: expected >= {row_offset + P} rows of {width} {dtype} with contiguous rows, "
                             f"got {tuple(given.shape)} {given.dtype}")
        return given[row_offset:row_offset + P]

    rows = _buf(out, "out", D, x.dtype) if bf16 else None
    q = _buf(out_q, "out_q", D, torch.float8_e4m3fn) if fp8 else None
    s = _buf(out_scale, "out_scale", D // QUANT_BLOCK, torch.float32) if fp8 else None
    if fp8 and s.stride(0) != D // QUANT_BLOCK:
        raise ValueError("out_scale: rows must be contiguous")
    if P:
        dummy = rows if rows is not None else q
        BLOCK_P = 16
        _permute_kernel[(cdiv(P, BLOCK_P),)](
            x, plan.order, dummy, q if fp8 else dummy, s if fp8 else x, P, D, x.stride(0), dummy.stride(0),
            q.stride(0) if fp8 else 0, plan.top_k, WRITE_OUT=bf16, QUANT=fp8, BLOCK_P=BLOCK_P,
            BLOCK_D=QUANT_BLOCK if fp8 else min(256, next_pow2(D)), num_warps=4)
    return rows, q, s


@triton.jit
def _combine_kernel(y_ptr, pos_ptr, w_ptr, out_ptr, N, D, TOP_K, HAS_W: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tmask = toks < N
    m = tmask[:, None] & (cols < D)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for j in range(0, TOP_K):  # slot order: the sum's bits do not depend on the device's scheduling
        p = tl.load(pos_ptr + toks * TOP_K + j, mask=tmask, other=0).to(tl.int64)
        v = tl.load(y_ptr + p[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_W:
            v = v * tl.load(w_ptr + toks * TOP_K + j, mask=tmask, other=0.0)[:, None]
        acc += v
    tl.store(out_ptr + toks.to(tl.int64)[:, None] * D + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=m)


def combine(y: torch.Tensor, plan: RoutingPlan, w: torch.Tensor | None, out_dtype: torch.dtype | None = None
            ) -> torch.Tensor:
    """out[t] = sum_j w[t, j] y[pos[t, j]] (w None: 1), fp32 in slot order -> [N, D] in out_dtype (y's)."""
    N, k = plan.pos.shape
    D = y.shape[1]
    y = y.contiguous()
    out = torch.empty(N, D, device=y.device, dtype=out_dtype or y.dtype)
    if N and D:
        BT, BD = 8, min(256, next_pow2(D))
        wf = w.float().contiguous() if w is not None else y
        _combine_kernel[(cdiv(N, BT), cdiv(D, BD))](y, plan.pos, wf, out, N, D, k, HAS_W=w is not None,
                                                    BLOCK_T=BT, BLOCK_D=BD, num_warps=4)
    return out


@triton.jit
def _combine_bwd_kernel(dout_ptr, y_ptr, pos_ptr, w_ptr, dy_ptr, dw_ptr, N, D, TOP_K: tl.constexpr,
                        WRITE_DY: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = toks < N
    for j in range(0, TOP_K):
        p = tl.load(pos_ptr + toks * TOP_K + j, mask=tmask, other=0).to(tl.int64)
        wj = tl.load(w_ptr + toks * TOP_K + j, mask=tmask, other=0.0)
        dw = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):  # fixed order over the width
            cols = d0 + tl.arange(0, BLOCK_D)
            m = tmask[:, None] & (cols < D)[None, :]
            g = tl.load(dout_ptr + toks.to(tl.int64)[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
            v = tl.load(y_ptr + p[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
            dw += tl.sum(g * v, axis=1)
            if WRITE_DY:  # (else read in place by a GatheredRows of dout: the same product and rounding)
                tl.store(dy_ptr + p[:, None] * D + cols[None, :], (g * wj[:, None]).to(dy_ptr.dtype.element_ty),
                         mask=m)
        tl.store(dw_ptr + toks * TOP_K + j, dw, mask=tmask)


def combine_backward(dout: torch.Tensor, y: torch.Tensor, plan: RoutingPlan, w: torch.Tensor, *,
                     write_dy: bool = True) -> tuple[torch.Tensor | GatheredRows, torch.Tensor]:
    """Gradients of `combine`: dy[pos[t, j]] = w[t, j] dout[t] (y's dtype), dw[t, j] = <dout[t], y[pos[t, j]]>
    (fp32, a fixed-order sum over the width). write_dy=False: dy is returned as the `GatheredRows` that yields it
    (for consumers that read it once or twice, e.g. the FP8 quantisers), and only dw is computed."""
    N, k = plan.pos.shape
    D = y.shape[1]
    dout = dout.contiguous()
    wf = w.float().contiguous()
    dy = torch.empty_like(y) if write_dy else GatheredRows(dout, plan.order, k, wf.view(-1), y.dtype)
    dw = torch.empty(N, k, device=y.device, dtype=torch.float32)
    if N:
        BT = 8
        _combine_bwd_kernel[(cdiv(N, BT),)](dout, y, plan.pos, wf, dy if write_dy else dw, dw, N, D, TOP_K=k,
                                            WRITE_DY=write_dy, BLOCK_T=BT, BLOCK_D=min(256, next_pow2(D)),
                                            num_warps=4)
    return dy, dw
