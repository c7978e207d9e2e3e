"""Multi-LoRA Triton kernels: SGMV-style shrink and expand over contiguous segments of one adapter (Punica,
arXiv 2310.18547; S-LoRA's MBGMM). A decode batch is the BGMV case: every token its own segment of length 1.

Each program owns BLOCK_M rows of one segment (and, for expand, BLOCK_O output columns) and reduces over the
inner dimension in a fixed order with no atomics: results are deterministic, and a row's value depends only on
its own inputs and its adapter. A segment of slot -1 is skipped (its rows keep the base). `sgmv_lora` builds the
segments on the host from the slots (one device-to-host copy a forward); `bgmv_lora` (inference) builds one
length-1 segment a token on the device, so its launches do not depend on the slots' values and a CUDA graph can
replay it with new slots (k3.rollout.graphs). Spec: `naive.py` (tests/kernels/test_lora_sgmv.py, interpreter on
CPU)."""
from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from k3_kernels.launch import cdiv, next_pow2
from k3_kernels.lora.naive import check_lora_args, segments


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, seg_ptr, K, R, x_stride, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_R: tl.constexpr):
    sid = tl.program_id(0)
    start = tl.load(seg_ptr + sid * 3)
    length = tl.load(seg_ptr + sid * 3 + 1)
    slot = tl.load(seg_ptr + sid * 3 + 2).to(tl.int64)
    m0 = tl.program_id(1) * BLOCK_M
    if (m0 < length) & (slot >= 0):
        rows = m0 + tl.arange(0, BLOCK_M)
        rmask = rows < length
        r64 = (start + rows).to(tl.int64)
        rr = tl.arange(0, BLOCK_R)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            kmask = kk < K
            x = tl.load(x_ptr + r64[:, None] * x_stride + kk[None, :], mask=rmask[:, None] & kmask[None, :],
                        other=0.0).to(tl.float32)
            a = tl.load(a_ptr + slot * R * K + rr[None, :] * K + kk[:, None],
                        mask=(rr < R)[None, :] & kmask[:, None], other=0.0).to(tl.float32)   # A[slot].T tile
            acc += tl.dot(x, a, input_precision="ieee")
        tl.store(h_ptr + r64[:, None] * R + rr[None, :], acc, mask=rmask[:, None] & (rr < R)[None, :])


@triton.jit
def _expand_kernel(h_ptr, b_ptr, base_ptr, y_ptr, seg_ptr, scale_ptr, O, R, base_stride,
                   BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr):
    sid = tl.program_id(0)
    start = tl.load(seg_ptr + sid * 3)
    length = tl.load(seg_ptr + sid * 3 + 1)
    slot = tl.load(seg_ptr + sid * 3 + 2).to(tl.int64)
    m0 = tl.program_id(1) * BLOCK_M
    if (m0 < length) & (slot >= 0):
        rows = m0 + tl.arange(0, BLOCK_M)
        rmask = rows < length
        r64 = (start + rows).to(tl.int64)
        oo = tl.program_id(2) * BLOCK_O + tl.arange(0, BLOCK_O)
        omask = oo < O
        rr = tl.arange(0, BLOCK_R)
        h = tl.load(h_ptr + r64[:, None] * R + rr[None, :], mask=rmask[:, None] & (rr < R)[None, :], other=0.0)
        bt = tl.load(b_ptr + slot * O * R + oo[None, :] * R + rr[:, None], mask=(rr < R)[:, None] & omask[None, :],
                     other=0.0).to(tl.float32)                                                  # B[slot].T tile
        scale = tl.load(scale_ptr + slot)
        m = rmask[:, None] & omask[None, :]
        base = tl.load(base_ptr + r64[:, None] * base_stride + oo[None, :], mask=m, other=0.0).to(tl.float32)
        y = base + scale * tl.dot(h, bt, input_precision="ieee")
        tl.store(y_ptr + r64[:, None] * O + oo[None, :], y.to(y_ptr.dtype.element_ty), mask=m)


def _blocks(max_len: int) -> int:
    return max(16, min(64, next_pow2(max_len)))


def _shrink(x: torch.Tensor, a: torch.Tensor, seg: torch.Tensor, max_len: int) -> torch.Tensor:
    """h [N, r] fp32: x[i] @ A[slot].T on the segments' rows, 0 elsewhere."""
    N, K = x.shape
    R = a.shape[1]
    h = torch.zeros(N, R, device=x.device, dtype=torch.float32)
    BM = _blocks(max_len)
    _shrink_kernel[(seg.shape[0], cdiv(max_len, BM))](x, a, h, seg, K, R, x.stride(0), BLOCK_M=BM, BLOCK_K=32,
                                                      BLOCK_R=max(16, next_pow2(R)))
    return h


def _expand(h: torch.Tensor, b: torch.Tensor, base: torch.Tensor, seg: torch.Tensor, scale: torch.Tensor,
            max_len: int) -> torch.Tensor:
    """base + scale[slot] * h[i] @ B[slot].T on the segments' rows (a new tensor; base's rows elsewhere)."""
    R, O = b.shape[2], b.shape[1]
    y = base.clone() if base.is_contiguous() else base.contiguous().clone()
    BM, BO = _blocks(max_len), 64
    _expand_kernel[(seg.shape[0], cdiv(max_len, BM), cdiv(O, BO))](h, b, base, y, seg, scale, O, R, base.stride(0),
                                                                   BLOCK_M=BM, BLOCK_O=BO,
                                                                   BLOCK_R=max(16, next_pow2(R)))
    return y


_LAST_SLOTS: list = [None, -1, None]   # weakref to the last slots tensor, its version, its host segments


def _segments_of(slots: torch.Tensor, n_adapters: int) -> torch.Tensor:
    """Host segments of `slots`, checked against the stack size; memoised for the last slots tensor (a forward
    passes the same one to every projection: one device-to-host copy per forward instead of one per projection).
    A hit needs the same live tensor object at the same version, so its values cannot have changed (inference
    tensors have no version counter: for them the same object is enough; LoRAManager builds a new one per forward
    and never writes it)."""
    ref, version, seg = _LAST_SLOTS
    now = None if slots.is_inference() else slots._version
    if ref is not None and ref() is slots and version == now:
        if seg.shape[0] and int(seg[:, 2].max()) >= n_adapters:
            raise ValueError(f"slots: entries must be in [-1, {n_adapters}), got up to {int(seg[:, 2].max())}")
        return seg
    s = slots.cpu()
    if s.numel() and (int(s.min()) < -1 or int(s.max()) >= n_adapters):
        raise ValueError(f"slots: entries must be in [-1, {n_adapters}), got [{int(s.min())}, {int(s.max())}]")
    seg = segments(s)
    _LAST_SLOTS[:] = [weakref.ref(slots), now, seg]
    return seg


class _SGMV(torch.autograd.Function):
    """y = base + scale[slot] * (x A[slot]^T) B[slot]^T with gradients for x, base, A and B.

    Backward, for the rows of slot s: dh = scale_s dy B_s (the shrink kernel over B^T), dx = dh A_s (the expand
    kernel over A^T), dA_s = dh^T x, dB_s = scale_s dy^T h (one GEMM per adapter over its rows, in row order): every
    reduction has a fixed order, so gradients are deterministic and an adapter's depend only on its own rows."""

    @staticmethod
    def forward(ctx, x, base, a, b, slots, scale):
        seg_host = _segments_of(slots, a.shape[0])
        seg = seg_host.to(x.device, non_blocking=True)
        ctx.seg_host = seg_host
        if seg.shape[0] == 0:
            y, h, max_len = base.contiguous().clone(), None, 0
        else:
            max_len = int(seg_host[:, 1].max())
            h = _shrink(x, a, seg, max_len)
            y = _expand(h, b, base, seg, scale, max_len)
        ctx.save_for_backward(x, a, b, slots, scale, h)
        ctx.seg, ctx.max_len = seg, max_len
        return y

    @staticmethod
    def backward(ctx, dy):
        x, a, b, slots, scale, h = ctx.saved_tensors
        seg, max_len = ctx.seg, ctx.max_len
        dx = da = db = None
        if h is None:
            if ctx.needs_input_grad[0]:
                dx = torch.zeros_like(x)
            if ctx.needs_input_grad[2]:
                da = torch.zeros_like(a)
            if ctx.needs_input_grad[3]:
                db = torch.zeros_like(b)
            return dx, dy, da, db, None, None
        dy = dy.contiguous()
        row_scale = torch.where(slots >= 0, scale[slots.clamp(min=0).long()], 0.0)
        dh = _shrink(dy, b.transpose(1, 2).contiguous(), seg, max_len) * row_scale[:, None]
        if ctx.needs_input_grad[0]:
            dx = _expand(dh, a.transpose(1, 2).contiguous(), torch.zeros_like(x), seg,
                         torch.ones_like(scale), max_len)
        if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
            da = torch.zeros_like(a) if ctx.needs_input_grad[2] else None
            db = torch.zeros_like(b) if ctx.needs_input_grad[3] else None
            host = ctx.seg_host
            scales = scale.cpu().tolist()
            for s in sorted(set(host[:, 2].tolist())):   # each adapter's rows in row order (host-built index)
                pos = torch.cat([torch.arange(int(st), int(st) + int(n)) for st, n, sl in host.tolist() if sl == s])
                pos = pos.to(x.device, non_blocking=True)
                if da is not None:
                    da[s] = (dh[pos].t() @ x[pos].float()).to(a.dtype)
                if db is not None:
                    db[s] = (scales[s] * (dy[pos].float().t() @ h[pos])).to(b.dtype)
        return dx, dy, da, db, None, None


def _check_kernel_args(x: torch.Tensor, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                       scale: torch.Tensor) -> None:
    """Shapes, dtypes and layouts the kernels need (not the slots' values: no device-to-host read here)."""
    check_lora_args(x, a, b, slots, scale, check_values=False)
    if base.shape != (x.shape[0], b.shape[1]):
        raise ValueError(f"base: expected [{x.shape[0]}, {b.shape[1]}], got {tuple(base.shape)}")
    if x.stride(1) != 1 or base.stride(1) != 1:
        raise ValueError("x, base: the last dimension must be contiguous")


def sgmv_lora(x: torch.Tensor, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
              scale: torch.Tensor) -> torch.Tensor:
    """base + per-token LoRA (see naive.naive_multi_lora): x [N, in], base [N, out], A [S, r, in], B [S, out, r],
    slots [N] (-1 = none), scale [S]; differentiable in x, base, A and B. Tokens of one adapter should be
    contiguous (one segment each); any order is correct."""
    _check_kernel_args(x, base, a, b, slots, scale)   # the slots' values: _segments_of, on the host copy
    scale = scale.to(device=x.device, dtype=torch.float32).contiguous()
    return _SGMV.apply(x, base, a.contiguous(), b.contiguous(), slots.to(x.device), scale)


def bgmv_lora(x: torch.Tensor, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
              scale: torch.Tensor) -> torch.Tensor:
    """`sgmv_lora`'s forward with one segment a token, built on the device: no host read of the slots, launches
    fixed by the shapes alone (capturable in a CUDA graph whose slots change between replays). Inference only (no
    autograd); the slots are not range-checked (callers build them from their own lookup: k3.lora.LoRAManager's
    captured plan). A row's bits are `sgmv_lora`'s: each row is reduced alone in both."""
    _check_kernel_args(x, base, a, b, slots, scale)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, base, a, b)):
        raise ValueError("bgmv_lora: inference only (no autograd); training forwards take sgmv_lora")
    N = x.shape[0]
    if N == 0:
        return base.contiguous().clone()
    rows = torch.arange(N, device=x.device, dtype=torch.int32)
    seg = torch.stack([rows, torch.ones_like(rows), slots.to(device=x.device, dtype=torch.int32)], dim=1)
    a, b = a.contiguous(), b.contiguous()
    scale = scale.to(device=x.device, dtype=torch.float32).contiguous()
    return _expand(_shrink(x, a, seg, 1), b, base, seg, scale, 1)
