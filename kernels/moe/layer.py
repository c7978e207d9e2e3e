"""The routed experts as one autograd Function (forward, dgrad, wgrad) on the Triton kernels, and the public API.

    y = moe_experts(z, ids, weights, w1, w3, w2, beta, linear_beta, precision=Precision.BF16)

z [N, L] latent tokens; ids / weights [N, k] from the router (`fused_router`); w1, w3 [E, I, L], w2 [E, L, I] (the
k3.model.moe.RoutedExperts layout). Forward: plan (stable sort by expert) -> permute (FP8: quantised in the same
pass) -> gate/up GEMM with SiTU (FP8: H quantised in its epilogue) -> down GEMM -> combine in slot order.
Backward: combine's backward (rows' and gate weights' gradients) -> down dgrad with SiTU's backward fused -> gate/up
dgrad -> un-permute as a fixed-order sum; weight gradients per expert by one program per weight tile.
Saved for the backward: the permuted rows, G|U and H (bf16) and the down output. FP8 covers the forward GEMMs;
the backward runs in bf16 from the saved bf16 tensors (weights' FP8 copies are cached per weight version).
Spec: naive.naive_experts / naive_experts_fp8.
"""
from __future__ import annotations

import enum

import torch

from k3_kernels.moe import grouped_gemm as gg
from k3_kernels.moe.permute import QUANT_BLOCK, combine, combine_backward, permute_rows, plan_routing
from k3_kernels.moe.quant import quantize_weight_fp8


class Precision(enum.Enum):
    BF16 = "bf16"   # GEMM inputs in the activations' dtype (bf16, or fp32 in the interpreter tests)
    FP8 = "fp8"     # forward GEMMs in e4m3 with 1 x 128 / 128 x 128 block scales; backward in the activation dtype


_FP8_CACHE: dict[int, tuple[int, int, tuple[torch.Tensor, torch.Tensor]]] = {}


def fp8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 copy of an expert weight, requantised only when the tensor changed (its version counter moved)."""
    key = id(w)
    hit = _FP8_CACHE.get(key)
    if hit is not None and hit[0] == w.data_ptr() and hit[1] == w._version:
        return hit[2]
    with torch.no_grad():
        q = quantize_weight_fp8(w.detach())
    _FP8_CACHE[key] = (w.data_ptr(), w._version, q)
    return q


def clear_fp8_cache() -> None:
    """Drop the cached FP8 weight copies (they hold E x 3 x L x I bytes)."""
    _FP8_CACHE.clear()


class _ExpertsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, w, w1, w3, w2, ids, beta, linear_beta, fp8, training):
        plan = plan_routing(ids, w1.shape[0])
        xp, xq, xs = permute_rows(z, plan, bf16=not fp8 or training, fp8=fp8)
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
        if training:
            ctx.save_for_backward(w, w1, w3, w2, xp, gu, h, y)
            ctx.plan, ctx.meta = plan, (beta, linear_beta)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
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
        return dz, dw, dw1, dw3, dw2, None, None, None, None, None


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
    if precision is Precision.FP8 and (L % QUANT_BLOCK or I % QUANT_BLOCK):
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
                            precision is Precision.FP8, training)
