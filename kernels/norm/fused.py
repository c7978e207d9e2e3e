"""Batch-invariant RMSNorm and gated RMSNorm (Triton), forward and backward.

Batch invariance: each program normalises a fixed tile of BLOCK_M rows x the whole (padded) row; BLOCK_M, the
block width and the warp count depend on D only, and a row's reduction happens inside its own tile row, so the
bits of a row's output (and of its dx) do not depend on how many rows are in the batch or where the row sits.
The weight gradient is a sum over rows: the persistent backward keeps one fp32 partial per program (a fixed
number of programs, each walking a fixed set of rows), and `k3_kernels.reduce.colsum` sums that [P, D] buffer in
a fixed order (no atomics) straight into the weight's dtype: bitwise reproducible run to run for a given batch.

Host-side cost matters as much as the kernels at a few thousand rows: the Python side of a Triton op
(autograd.Function, argument binding, three launches, allocations) costs more host time than the kernels take.
Forward and backward are therefore a C++ autograd node (`csrc/rms_norm_node.cpp`, the same contract as torch's own
rms_norm) that launches these kernels: a specialisation's first launch goes through Triton here
(`_compile_and_launch`), later ones straight to the driver. The launch configuration is a function of D alone
(`config_of` in the node).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from k3_kernels.launch import launch_hooks_set, num_sms
from k3_kernels.reduce import _colsum_kernel


@triton.jit
def _rms_fwd_kernel(x_ptr, g_ptr, w_ptr, y_ptr, rstd_ptr, M, D, x_stride, g_stride, eps,
                    HAS_W: tl.constexpr, GATED: tl.constexpr, STORE_RSTD: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < M
    mask = rmask[:, None] & (cols[None, :] < D)
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rs = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    y = x * rs[:, None]
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    if GATED:
        y = y * tl.sigmoid(tl.load(g_ptr + r64 * g_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32))
    tl.store(y_ptr + r64 * D + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    if STORE_RSTD:
        tl.store(rstd_ptr + rows, rs, mask=rmask)


@triton.jit
def _rms_bwd_kernel(x_ptr, g_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, dg_ptr, dw_part_ptr, M, D, x_stride, g_stride,
                    HAS_W: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Persistent: program p walks row blocks p, p + P, ...; dx of a row depends on that row alone; the weight
    gradient's partial of program p goes to dw_part[p] (reduced over p by the caller). 1 / rms comes from the
    forward (recomputing it here adds a second dependent row reduction per row: measured 20% slower at 32K rows)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for blk in range(pid, tl.cdiv(M, BLOCK_M), nprog):
        rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        r64 = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + r64 * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + r64 * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rs = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        xh = x * rs[:, None]
        if GATED:
            s = tl.sigmoid(tl.load(g_ptr + r64 * g_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32))
            n = xh
            if HAS_W:
                n = xh * w[None, :]
            tl.store(dg_ptr + r64 * D + cols[None, :], (dy * n * s * (1.0 - s)).to(dg_ptr.dtype.element_ty),
                     mask=mask)
            dy = dy * s
        if HAS_W:
            dw_acc += dy * xh
            gx = dy * w[None, :]
        else:
            gx = dy
        dx = rs[:, None] * (gx - xh * (tl.sum(gx * xh, axis=1) / D)[:, None])
        tl.store(dx_ptr + r64 * D + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
    if HAS_W:
        tl.store(dw_part_ptr + pid * D + cols, tl.sum(dw_acc, axis=0), mask=cmask)


_KERNELS = {"rms_fwd": _rms_fwd_kernel, "rms_bwd": _rms_bwd_kernel, "colsum": _colsum_kernel}
_PARAM_KINDS = {"i32": "i", "i64": "l", "u64": "l", "fp32": "f"}


def _compile_and_launch(name: str, grid: int, args: list, constexprs: dict):
    """A kernel's launch from the C++ node when its specialisation is not cached there: Triton binds, compiles
    and launches it; the compiled function, block size, shared memory and runtime parameters (kernel-argument
    index, kind) go back so that later launches skip Python. None (come back here next time) under the
    interpreter, with launch hooks set (profilers see every launch) and for launches the node does not set up
    (clusters, scratch buffers, cooperative or PDL launches)."""
    compiled = _KERNELS[name][(grid,)](*args, **constexprs)
    if compiled is None or launch_hooks_set():
        return None
    if hasattr(compiled, "result"):
        compiled = compiled.result()
    md = compiled.metadata
    if (getattr(md, "num_ctas", 1) != 1 or getattr(md, "global_scratch_size", 0)
            or getattr(md, "profile_scratch_size", 0) or getattr(md, "launch_cooperative_grid", False)
            or getattr(md, "launch_pdl", False)):
        return None
    params = []
    for index, kind in enumerate(compiled.src.signature.values()):
        if kind == "constexpr":
            continue
        if not (kind.startswith("*") or kind in _PARAM_KINDS):
            return None
        params.append((index, "p" if kind.startswith("*") else _PARAM_KINDS[kind]))
    return compiled.function, 32 * md.num_warps, md.shared, params


@functools.lru_cache(maxsize=None)
def _node():
    """The C++ autograd node (csrc/rms_norm_node.cpp), built on first use (torch.utils.cpp_extension + ninja;
    cached under TORCH_EXTENSIONS_DIR)."""
    from torch.utils.cpp_extension import load
    module = load(name="k3_rms_norm_node", sources=[os.path.join(os.path.dirname(__file__), "csrc",
                                                                  "rms_norm_node.cpp")],
                  extra_cflags=["-O2"], verbose=False)
    module.set_compiler(_compile_and_launch)
    return module


def _rows(t: torch.Tensor, D: int, name: str) -> torch.Tensor:
    """[M, D] view with unit last stride; copies only if the leading dims cannot be flattened in place."""
    if t.shape[-1] != D:
        raise ValueError(f"{name}: expected last dim {D}, got shape {tuple(t.shape)}")
    if t.stride(-1) == 1 and t.dim() == 2:
        return t
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, D)
    except RuntimeError:
        return t.reshape(-1, D)


def _apply(x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    D = x.shape[-1]
    if gate is not None and (gate.shape != x.shape or gate.device != x.device):
        raise ValueError(f"gate: expected shape {tuple(x.shape)} on {x.device}, got {tuple(gate.shape)} "
                         f"on {gate.device}")
    if weight is not None:
        if weight.shape != (D,) or weight.device != x.device:
            raise ValueError(f"weight: expected shape ({D},) on {x.device}, got {tuple(weight.shape)} "
                             f"on {weight.device}")
        if not weight.is_contiguous():
            weight = weight.contiguous()
    x2 = _rows(x, D, "x")
    g2 = _rows(gate, D, "gate") if gate is not None else None
    if torch.is_grad_enabled() and (x.requires_grad or (gate is not None and gate.requires_grad)
                                    or (weight is not None and weight.requires_grad)):
        y = _node().rms_norm_node(x2, g2, weight, eps, 2, num_sms(x.device))
    else:
        y = _node().rms_norm_forward(x2, g2, weight, eps)
    return y if x.dim() == 2 else y.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """Batch-invariant RMSNorm over the last dim (fp32 math, output in x.dtype); same contract as `naive_rms_norm`."""
    return _apply(x, None, weight, float(eps))


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None,
                   eps: float = 1e-6) -> torch.Tensor:
    """Batch-invariant RMSNorm(x) * weight * sigmoid(gate) (KDA's output norm); same contract as
    `naive_gated_rms_norm`."""
    if gate is None:
        raise ValueError("gate: required for gated_rms_norm (use rms_norm without a gate)")
    return _apply(x, gate, weight, float(eps))
