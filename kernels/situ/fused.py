"""SiTU fused with the gate/up multiply (Triton), forward and backward (K3 Eq. 12, k3-architecture.md §5.3).

y = [b1 tanh(g/b1) sigmoid(g)] * [b2 tanh(u/b2)], fp32 math, output in gate.dtype. gate/up may be strided views
(e.g. the two halves of a fused gate_up projection); they are read in place.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3_kernels.launch import cdiv


@triton.jit
def _tanh(x):
    """tanh from exp (portable to the interpreter); odd Taylor series near 0 where 1 - exp(-2|x|) cancels."""
    ax = tl.abs(x)
    t = tl.exp(-2.0 * ax)
    big = (1.0 - t) / (1.0 + t)
    x2 = x * x
    small = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    r = tl.where(ax < 0.25, small, big)
    return tl.where(x < 0, -r, r)


@triton.jit
def situ_h(g, u, beta, linear_beta):
    """H = beta tanh(G / beta) sigmoid(G) * linear_beta tanh(U / linear_beta) (SiTU-and-mul), fp32: the MoE gate/up
    epilogues (Triton and Gluon) and the pass after the unfused Gluon gate/up all call this, so they give the same bits."""
    return beta * _tanh(g / beta) * tl.sigmoid(g) * (linear_beta * _tanh(u / linear_beta))


@triton.jit
def situ_grads(dh, g, u, beta, linear_beta):
    """(dG, dU) of H = beta tanh(G / beta) sigmoid(G) * linear_beta tanh(U / linear_beta), fp32: every kernel that
    differentiates SiTU-and-mul calls this, so they all give the same bits."""
    tg = _tanh(g / beta)
    sg = tl.sigmoid(g)
    tu = _tanh(u / linear_beta)
    dact = (1.0 - tg * tg) * sg + beta * tg * sg * (1.0 - sg)
    return dh * linear_beta * tu * dact, dh * beta * tg * sg * (1.0 - tu * tu)


@triton.jit
def _situ_kernel(g_ptr, u_ptr, dy_ptr, y_ptr, dg_ptr, du_ptr, M, I, g_stride, u_stride, beta, linear_beta,
                 BACKWARD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < M)[:, None] & (cols < I)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    g = tl.load(g_ptr + r64 * g_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r64 * u_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tg = _tanh(g / beta)
    sg = tl.sigmoid(g)
    tu = _tanh(u / linear_beta)
    act = beta * tg * sg
    lin = linear_beta * tu
    out = r64 * I + cols[None, :]
    if BACKWARD:
        dy = tl.load(dy_ptr + out, mask=mask, other=0.0).to(tl.float32)
        dact = (1.0 - tg * tg) * sg + beta * tg * sg * (1.0 - sg)
        tl.store(dg_ptr + out, (dy * lin * dact).to(dg_ptr.dtype.element_ty), mask=mask)
        tl.store(du_ptr + out, (dy * act * (1.0 - tu * tu)).to(du_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(y_ptr + out, (act * lin).to(y_ptr.dtype.element_ty), mask=mask)


_BLOCK_M, _BLOCK_I = 4, 512


def _rows(t: torch.Tensor) -> torch.Tensor:
    I = t.shape[-1]
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, I)
    except RuntimeError:
        return t.reshape(-1, I)


def _launch(g2, u2, beta, linear_beta, dy=None):
    M, I = g2.shape
    grid = (cdiv(M, _BLOCK_M), cdiv(I, _BLOCK_I))
    if dy is None:
        y = torch.empty(M, I, device=g2.device, dtype=g2.dtype)
        if M * I:
            _situ_kernel[grid](g2, u2, y, y, y, y, M, I, g2.stride(0), u2.stride(0), beta, linear_beta,
                               BACKWARD=False, BLOCK_M=_BLOCK_M, BLOCK_I=_BLOCK_I, num_warps=4)
        return y
    dg = torch.empty(M, I, device=g2.device, dtype=g2.dtype)
    du = torch.empty(M, I, device=g2.device, dtype=u2.dtype)
    if M * I:
        _situ_kernel[grid](g2, u2, dy, dg, dg, du, M, I, g2.stride(0), u2.stride(0), beta, linear_beta,
                           BACKWARD=True, BLOCK_M=_BLOCK_M, BLOCK_I=_BLOCK_I, num_warps=4)
    return dg, du


class _SiTUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, beta, linear_beta):
        g2, u2 = _rows(gate), _rows(up)
        ctx.save_for_backward(g2, u2)
        ctx.meta = (beta, linear_beta, gate.shape)
        return _launch(g2, u2, beta, linear_beta).view(gate.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        g2, u2 = ctx.saved_tensors
        beta, linear_beta, shape = ctx.meta
        dg, du = _launch(g2, u2, beta, linear_beta, dy.reshape(g2.shape).contiguous())
        return dg.view(shape), du.view(shape), None, None


def situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """Fused SiTU(gate) * capped(up); same contract as `naive_situ_and_mul`."""
    if gate.shape != up.shape or gate.device != up.device:
        raise ValueError(f"up: expected shape {tuple(gate.shape)} on {gate.device}, got {tuple(up.shape)} on {up.device}")
    if beta <= 0 or linear_beta <= 0:
        raise ValueError(f"beta, linear_beta: must be > 0, got {beta}, {linear_beta}")
    return _SiTUFn.apply(gate, up, float(beta), float(linear_beta))
