"""The routed experts as one autograd Function (forward, dgrad, wgrad) on the Triton kernels, and the public API.

    y = moe_experts(z, ids, weights, w1, w3, w2, beta, linear_beta, precision=Precision.BF16)

z [N, L] latent tokens; ids / weights [N, k] from the router (`fused_router`); w1, w3 [E, I, L], w2 [E, L, I] (the
k3.model.moe.RoutedExperts layout). Forward: plan (stable sort by expert) -> permute (FP8: quantised in the same
pass) -> gate/up GEMM with SiTU (FP8: H quantised in its epilogue) -> down GEMM -> combine in slot order.
Backward: combine's backward (rows' and gate weights' gradients) -> down dgrad with SiTU's backward fused -> gate/up
dgrad -> un-permute as a fixed-order sum; weight gradients per expert by one program per weight tile.
Saved for the backward: the permuted rows, G|U and H (bf16; FP8_FULL: the rows and H as the wgrads' FP8 operands)
and the down output. Precision.FP8 covers the forward GEMMs and runs the backward in bf16 from the saved bf16
tensors; Precision.FP8_FULL runs the dgrads and wgrads in e4m3 as well (fp8_grad.py), quantising the saved tensors
and the gradients as they come. The weights' FP8 copies (and their transposes, for the dgrads) are cached per
weight version. The backward runs its GEMMs on the kernels (`grouped_gemm.gemm_kernels`) the forward ran on.
Spec: naive.naive_experts / naive_experts_fp8 / naive_wgrad_fp8.
"""
from __future__ import annotations

import contextlib
import enum
import weakref

import torch

from k3_kernels.moe import fp8_grad
from k3_kernels.moe import grouped_gemm as gg
from k3_kernels.moe.permute import (QUANT_BLOCK, GatheredRows, combine, combine_backward, permute_rows,
                                    plan_routing)
from k3_kernels.moe.quant import quantize_weight_fp8


class Precision(enum.Enum):
    BF16 = "bf16"           # GEMM inputs in the activations' dtype (bf16, or fp32 in the interpreter tests)
    FP8 = "fp8"             # forward GEMMs in e4m3 with 1 x 128 / 128 x 128 block scales; backward in bf16
    FP8_FULL = "fp8_full"   # forward, dgrad and wgrad GEMMs in e4m3 (fp8_grad.py: DeepSeek-V3's recipe)


# key -> ((data_ptr, version) of each source weight, (q, scale), weak references to the sources): requantised
# only when a source changed. Keys hold id()s, which Python reuses once a tensor dies (and the allocator its
# data_ptr): an entry is used only for the very tensors it was made from, and dropped when one of them dies.
_FP8_CACHE: dict[tuple, tuple[tuple, tuple[torch.Tensor, torch.Tensor], tuple[weakref.ref, ...]]] = {}


def fp8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 copy of an expert weight, requantised only when the tensor changed (its version counter moved)."""
    return _cached(("w", id(w)), (w,), lambda: quantize_weight_fp8(w.detach()))


def fp8_weight_t(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 copy of w^T ([E, K, N] from w [E, N, K]) for the dgrads: 128 x 128 blocks quantise the same either
    way round, so it is the forward copy transposed (cached per weight version too)."""
    return _cached(("t", id(w)), (w,), lambda: tuple(t.transpose(1, 2).contiguous() for t in fp8_weight(w)))


def fp8_weight_t13(w1: torch.Tensor, w3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[W1^T | W3^T] in FP8 ([E, L, 2I], scales [E, L / 128, 2I / 128]): the gate/up dgrad's B over K = 2I."""
    def make():
        (q1, s1), (q3, s3) = fp8_weight(w1), fp8_weight(w3)
        return (torch.cat([q1.transpose(1, 2), q3.transpose(1, 2)], dim=2),
                torch.cat([s1.transpose(1, 2), s3.transpose(1, 2)], dim=2))
    return _cached(("t13", id(w1), id(w3)), (w1, w3), make)


def _cached(key, sources: tuple[torch.Tensor, ...], make):
    stamp = tuple((t.data_ptr(), t._version) for t in sources)
    hit = _FP8_CACHE.get(key)
    same_tensors = hit is not None and all(ref() is t for ref, t in zip(hit[2], sources))
    if same_tensors and hit[0] == stamp:
        return hit[1]
    with torch.no_grad():
        value = make()
    _FP8_CACHE[key] = (stamp, value, hit[2] if same_tensors else tuple(weakref.ref(t) for t in sources))
    if not same_tensors:  # once per tensor, not per version: the entry goes when a source does
        for t in sources:
            weakref.finalize(t, _drop, key).atexit = False
    return value


def _drop(key) -> None:
    """A source of `key`'s entry died: drop the entry, unless it was remade meanwhile for live tensors."""
    hit = _FP8_CACHE.get(key)
    if hit is not None and any(ref() is None for ref in hit[2]):
        del _FP8_CACHE[key]


def clear_fp8_cache() -> None:
    """Drop the cached FP8 weight copies (they hold E x 3 x L x I bytes)."""
    _FP8_CACHE.clear()


class _ExpertsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, w, w1, w3, w2, ids, beta, linear_beta, fp8, training, fp8_grads):
        plan = plan_routing(ids, w1.shape[0])
        # (FP8_FULL saves X only as the wgrad's token blocks, read from z in place: no bf16 permuted copy)
        xp, xq, xs = permute_rows(z, plan, bf16=not fp8 or (training and not fp8_grads), fp8=fp8)
        if fp8:
            (w1q, w1s), (w3q, w3s), (w2q, w2s) = fp8_weight(w1), fp8_weight(w3), fp8_weight(w2)
            gu, h, hq, hs = gg.gate_up(xq, w1, w3, plan, beta, linear_beta, act_dtype=z.dtype,
                                       save_gu=training, write_h=training, quant_h=True,
                                       fp8=(xq, xs, w1q, w1s, w3q, w3s))
            y = gg.down(hq, w2, plan, z.dtype, fp8=(hq, hs, w2q, w2s))
        else:
            gu, h, _, _ = gg.gate_up(xp, w1, w3, plan, beta, linear_beta, save_gu=training)
            y = gg.down(h, w2, plan, z.dtype)
        out = combine(y, plan, w, z.dtype)
        if training and fp8_grads:
            # the wgrads' operands from X and H, quantised in 128-token blocks now: saved instead of X and H in bf16
            tiles, _ = fp8_grad.token_block_tiles(plan)
            xbq, xbs = fp8_grad.quantize_token_blocks(GatheredRows(z, plan.order, plan.top_k), tiles)
            hbq, hbs = fp8_grad.quantize_token_blocks(h, tiles)
            ctx.save_for_backward(w, w1, w3, w2, xbq, xbs, gu, hbq, hbs, y)
        elif training:
            ctx.save_for_backward(w, w1, w3, w2, xp, gu, h, y)
        if training:
            ctx.plan, ctx.meta, ctx.fp8_grads = plan, (beta, linear_beta), fp8_grads
            ctx.gemm_kernels = gg.gemm_kernels_override()  # the backward's GEMMs follow the forward's choice
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        # the backward's GEMMs run on the kernels the forward ran on (a `gemm_kernels` block around the forward)
        with gg.gemm_kernels(ctx.gemm_kernels) if ctx.gemm_kernels is not None else contextlib.nullcontext():
            if ctx.fp8_grads:
                w, w1, w3, w2, xbq, xbs, gu, hbq, hbs, y = ctx.saved_tensors
                dy, dw = combine_backward(dout, y, ctx.plan, w, write_dy=False)  # dy: read in place twice
                return _fp8_backward(ctx, dout, dy, dw, (xbq, xbs), gu, (hbq, hbs), w1, w3, w2)
            return _backward(ctx, dout)


def _backward(ctx, dout):
    """The dgrads and wgrads in the activations' dtype (Precision.BF16 and FP8)."""
    w, w1, w3, w2, xp, gu, h, y = ctx.saved_tensors
    plan, (beta, linear_beta) = ctx.plan, ctx.meta
    dy, dw = combine_backward(dout, y, plan, w)
    dgu = gg.down_dgrad_situ(dy, w2, gu, plan, beta, linear_beta)
    I = w1.shape[1]
    dw2 = gg.wgrad(dy, h, plan, w2.dtype) if ctx.needs_input_grad[4] else None
    dw1 = gg.wgrad(dgu[:, :I], xp, plan, w1.dtype) if ctx.needs_input_grad[2] else None
    dw3 = gg.wgrad(dgu[:, I:], xp, plan, w3.dtype) if ctx.needs_input_grad[3] else None
    dz = None
    if ctx.needs_input_grad[0]:
        dxp = gg.gate_up_dgrad(dgu, w1, w3, plan)
        dz = combine(dxp, plan, None, dout.dtype)  # each token's k rows summed in slot order
    return dz, dw, dw1, dw3, dw2, None, None, None, None, None, None


def _fp8_backward(ctx, dout, dy, dw, x_blocks, gu, h_blocks, w1, w3, w2):
    """Precision.FP8_FULL: the dgrads and wgrads of the routed experts in e4m3 (fp8_grad.py); x_blocks / h_blocks:
    the forward's permuted rows and H quantised in 128-token blocks; dy: combine's row gradients, read in place."""
    plan, (beta, linear_beta) = ctx.plan, ctx.meta
    E, I = w1.shape[0], w1.shape[1]
    tiles, tile_offsets = fp8_grad.token_block_tiles(plan)
    dy_rows, dy_blocks = fp8_grad.quantize_rows(dy), fp8_grad.quantize_token_blocks(dy, tiles)  # dgrad's, dW2's
    dh = gg.scaled_mm(dy_rows, fp8_weight_t(w2), plan, gu.dtype)
    dgu, dgu_rows = fp8_grad.situ_backward_rows(dh, gu, beta, linear_beta)  # dG | dU and its rows, one pass
    dgu_blocks = fp8_grad.quantize_token_blocks(dgu, tiles)
    dw1 = dw3 = dw2 = dz = None
    if ctx.needs_input_grad[4]:
        dw2 = fp8_grad.wgrad_fp8(dy_blocks, h_blocks, tile_offsets, E, w2.dtype)
    if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
        dw1, dw3 = fp8_grad.wgrad_fp8(dgu_blocks, x_blocks, tile_offsets, E, w1.dtype, split=I)
    if ctx.needs_input_grad[0]:
        dxp = gg.scaled_mm(dgu_rows, fp8_weight_t13(w1, w3), plan, gu.dtype)
        dz = combine(dxp, plan, None, dout.dtype)  # each token's k rows summed in slot order
    return dz, dw, dw1, dw3, dw2, None, None, None, None, None, None


def check_expert_args(z: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                      w2: torch.Tensor, precision: Precision, ids_checked: bool = False) -> None:
    """Clear errors, naming the tensor, before any kernel runs. `ids_checked`: the caller guarantees the ids lie in
    [0, E) (a router's own top-k, or ids it has range-checked), so their values are not read (a host sync on CUDA)."""
    if z.dim() != 2:
        raise ValueError(f"z: expected [N, L], got shape {tuple(z.shape)}")
    N, L = z.shape
    if w1.dim() != 3 or w1.shape[2] != L:
        raise ValueError(f"w1: expected [E, I, {L}], got {tuple(w1.shape)}")
    E, I, _ = w1.shape
    if w3.shape != w1.shape:
        raise ValueError(f"w3: expected {tuple(w1.shape)}, got {tuple(w3.shape)}")
    if w2.shape != (E, L, I):
        raise ValueError(f"w2: expected [{E}, {L}, {I}], got {tuple(w2.shape)}")
    if ids.dim() != 2 or ids.shape[0] != N:
        raise ValueError(f"ids: expected [{N}, k], got {tuple(ids.shape)}")
    if w.shape != ids.shape:
        raise ValueError(f"weights: expected {tuple(ids.shape)}, got {tuple(w.shape)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids: expected int32/int64, got {ids.dtype}")
    for name, t in (("w1", w1), ("w3", w3), ("w2", w2), ("ids", ids), ("weights", w)):
        if t.device != z.device:
            raise ValueError(f"{name}: on {t.device}, z on {z.device}")
    for name, t in (("w1", w1), ("w3", w3), ("w2", w2)):
        if t.dtype != z.dtype:
            raise ValueError(f"{name}: dtype {t.dtype}, z is {z.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name}: must be contiguous")
    if not isinstance(precision, Precision):
        raise ValueError(f"precision: expected a Precision, got {precision!r}")
    if precision is not Precision.BF16 and (L % QUANT_BLOCK or I % QUANT_BLOCK):
        raise ValueError(f"w1: FP8 needs latent and intermediate sizes divisible by {QUANT_BLOCK}, got {L}, {I}")
    # (on CUDA one host sync: an id out of range would send the kernels outside the weights)
    if not ids_checked and ids.numel() and bool(((ids < 0) | (ids >= E)).any()):
        raise ValueError(f"ids: expert ids must lie in [0, {E}), got [{int(ids.min())}, {int(ids.max())}]")


def moe_experts(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                w2: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0,
                precision: Precision = Precision.BF16, ids_checked: bool = False) -> torch.Tensor:
    """sum_j weights[t, j] E_{ids[t, j]}(z[t]) -> [N, L] in z's dtype (differentiable in z, weights, w1, w3, w2).
    `ids_checked`: see `check_expert_args`."""
    check_expert_args(z, ids, weights, w1, w3, w2, precision, ids_checked)
    if beta <= 0 or linear_beta <= 0:
        raise ValueError(f"beta, linear_beta: must be > 0, got {beta}, {linear_beta}")
    # (inside a Function's forward, needs_input_grad says True even under no_grad: decide here what to save)
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (z, weights, w1, w3, w2))
    return _ExpertsFn.apply(z.contiguous(), weights.float(), w1, w3, w2, ids, float(beta), float(linear_beta),
                            precision is not Precision.BF16, training, precision is Precision.FP8_FULL)
