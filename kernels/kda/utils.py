"""Triton helpers shared by the chunked KDA kernels: chunk rows of the plan, the state passes' program ids, token
tiles, fast exp2, and the whole-chunk test of the intra kernels."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _chunk_rows(cu, cidx, c):
    """(sequence, first token, valid rows from that token) of global chunk c."""
    n = tl.load(cidx + 2 * c).to(tl.int64)
    t0 = tl.load(cu + n).to(tl.int64) + tl.load(cidx + 2 * c + 1).to(tl.int64) * 64
    return n, t0, tl.load(cu + n + 1).to(tl.int64) - t0


@triton.jit
def _state_program(seqs, V, BV: tl.constexpr):
    """(sequence, value head, V block) of a state-pass program on the `plan.state_grid` grid: the V blocks of one
    (sequence, head) are adjacent programs, so the blocks that read the same chunk operands run side by side and
    the later ones find them in L2."""
    blocks = tl.cdiv(V, BV)
    pid = tl.program_id(0)
    n = tl.load(seqs + pid // blocks).to(tl.int64)  # this launch's sequences (`_state_classes`)
    return n, tl.program_id(1).to(tl.int64), pid % blocks


@triton.jit
def _intra_program(q, k, Gc, cu, cidx, c_first, H, HV, K, BK: tl.constexpr):
    """This (chunk c_first + program, value head) program's value head, first token, valid rows, chunk-layout
    base, G tile pointer and its q/k heads."""
    c = tl.program_id(0).to(tl.int64) + c_first
    hv = tl.program_id(1).to(tl.int64)
    _, t0, nv = _chunk_rows(cu, cidx, c)
    base = c * HV + hv
    h = hv // (HV // H)
    return hv, t0, nv, base, Gc + base * 64 * BK, q + h * K, k + h * K


@triton.jit
def _tile(p, t0, rows, nv, stride, oc, K):
    """[len(rows), len(oc)] fp32 tile of token rows t0 + rows of a token-major tensor (row stride `stride`), zeros
    past nv rows / K columns."""
    return tl.load(p + (t0 + rows)[:, None] * stride + oc[None, :], mask=(rows < nv)[:, None] & (oc < K)[None, :],
                   other=0.).to(tl.float32)


@triton.jit
def _chunk_tile(p, t0, nv, stride, oc, K):
    """`_tile` of all 64 rows of the chunk."""
    return _tile(p, t0, tl.arange(0, 64), nv, stride, oc, K)


LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _exp2(x, FAST: tl.constexpr):
    """2^x. FAST (CUDA): one MUFU instruction, `ex2.approx.ftz` (results below 2^-126 flush to zero, harmless for
    decay factors), instead of the subnormal range fix-ups around `ex2.approx` that `tl.exp` / `tl.exp2` compile to
    (five instructions per element with the log2 e scaling; the forward intra kernel evaluates ~28 [64, 32] tiles
    of them per program). The interpreter takes `tl.exp2`."""
    if FAST:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return tl.exp2(x)


@triton.jit
def _whole_chunk(pG, BK: tl.constexpr):
    """Whether every channel of the chunk whose G tile starts at pG spans at most 80 of log-decay, the test for the
    whole-chunk dots of the forward and backward intra kernels (factors within e^{+-40} around each channel's
    midpoint). G never rises, so a channel spans its first row's G minus its last's. Batch invariant: the chunk's
    own data."""
    ok = tl.arange(0, BK)
    return tl.max(tl.load(pG + ok) - tl.load(pG + 63 * BK + ok), 0) <= 80.
