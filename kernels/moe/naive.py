"""Plain-torch spec of K3's routed-expert MoE layer (k3-architecture.md §5): the router, the permutation, the
per-expert SiTU MLPs as grouped GEMMs, the combine, FP8 (e4m3, 1 x 128 activation / 128 x 128 weight block)
quantisation and MXFP4 dequantisation. Backward = autograd through these functions. The Triton kernels beside it
(router.py, permute.py, grouped_gemm.py, layer.py) are tested against it (tests/kernels/test_moe*.py).

Conventions the kernels follow exactly:
* router: s = sigmoid(x W^T) (fp32 accumulation); selection by s + bias, top-k in descending order with ties broken
  by the lowest expert id; weights = s at the chosen ids, renormalised (sum + 1e-20), times the scaling. Replay:
  forced ids (rows whose first id is -1 route freely), weights recomputed from the current scores.
* permutation: (token, slot) pairs sorted by expert, stable (within an expert by token then slot);
  `pos[t, j]` = the permuted row of pair (t, j); `offsets[e]` = the first row of expert e.
* expert e on its rows X_e: H = SiTU(X_e W1_e^T, X_e W3_e^T) (fp32 math, rounded to the activation dtype once),
  Y_e = H W2_e^T; the GEMMs accumulate in fp32 and round once.
* combine: out[t] = sum_{j = 0..k-1} w[t, j] * Y[pos[t, j]], in fp32 in slot order, rounded once.
"""
from __future__ import annotations

import torch

from k3_kernels.situ.naive import naive_situ_and_mul

FP8_MAX = 448.0          # largest finite float8_e4m3fn
QUANT_BLOCK = 128        # 1 x 128 activation blocks, 128 x 128 weight blocks
AMAX_FLOOR = FP8_MAX * 2.0 ** -126  # block maxima floored here, so 448 / amax stays finite (2^126 at most)
MXFP4_GROUP = 32
# E2M1 magnitudes by code (bit 3 is the sign)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# ---------------------------------------------------------------------------------------------------------- router
def naive_router(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                 renormalize: bool = True, scaling: float = 1.0, forced: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, d], weight [E, d], bias [E] | None, forced [N, k] | None -> (ids [N, k] int64, weights [N, k] fp32)."""
    scores = torch.sigmoid(x.float() @ weight.float().t())
    sel = scores if bias is None else scores + bias.float()
    # stable descending sort: equal scores keep ascending ids, i.e. ties go to the lowest id
    idx = torch.sort(sel.detach(), dim=-1, descending=True, stable=True).indices[:, :top_k]
    if forced is not None:
        idx = torch.where(forced[:, :1] < 0, idx, forced.long())
    w = scores.gather(-1, idx)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return idx, w * scaling


# ----------------------------------------------------------------------------------------------------- permutation
def naive_permutation(idx: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """idx [N, k] -> (order [N k]: the pair id (t k + j) of each permuted row, pos [N, k]: the permuted row of each
    pair, offsets [E + 1]: expert e's rows are offsets[e]:offsets[e + 1])."""
    flat = idx.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=idx.device)
    counts = torch.bincount(flat, minlength=n_experts)
    offsets = torch.zeros(n_experts + 1, dtype=torch.long, device=idx.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return order, pos.view(idx.shape), offsets


def naive_permute(x: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """Permuted rows: row p = x[order[p] // k]."""
    return x[order // top_k]


def naive_combine(y: torch.Tensor, pos: torch.Tensor, w: torch.Tensor | None, out_dtype: torch.dtype | None = None
                  ) -> torch.Tensor:
    """out[t] = sum_j w[t, j] y[pos[t, j]] (w None: weights 1), fp32 in slot order, rounded once."""
    acc = torch.zeros(pos.shape[0], y.shape[1], dtype=torch.float32, device=y.device)
    for j in range(pos.shape[1]):
        term = y[pos[:, j]].float()
        acc = acc + (term if w is None else term * w[:, j:j + 1].float())
    return acc.to(out_dtype or y.dtype)


# ---------------------------------------------------------------------------------------------------- expert MLPs
def naive_grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows offsets[e]:offsets[e+1] of a [P, K] times b[e]^T ([E, N, K]) -> [P, N], fp32 accumulation."""
    out = a.new_empty(a.shape[0], b.shape[1])
    for e in range(b.shape[0]):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        out[lo:hi] = (a[lo:hi].float() @ b[e].float().t()).to(a.dtype)
    return out


def naive_experts(z: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                  w2: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """sum_j w[t, j] E_{idx[t, j]}(z[t]) for z [N, L], w1/w3 [E, I, L], w2 [E, L, I] (differentiable)."""
    order, pos, offsets = naive_permutation(idx, w1.shape[0])
    xp = naive_permute(z, order, idx.shape[1])
    parts = []
    for e in range(w1.shape[0]):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        xe = xp[lo:hi].float()
        g, u = (xe @ w1[e].float().t()).to(z.dtype), (xe @ w3[e].float().t()).to(z.dtype)
        h = naive_situ_and_mul(g, u, beta, linear_beta)
        parts.append((h.float() @ w2[e].float().t()).to(z.dtype))
    y = torch.cat(parts) if parts else z.new_zeros(0, w2.shape[1])
    return naive_combine(y, pos, w, z.dtype)


def naive_moe_layer(x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor | None, w1, w3, w2,
                    top_k: int, shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                    beta: float = 4.0, linear_beta: float = 25.0, forced: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer the benchmark measures, at the expert width: router + routed experts (+ shared SiTU MLP with
    gate/up/down weights [S, L], [S, L], [L, S]) -> (y [N, L], ids [N, k])."""
    idx, w = naive_router(x, router_weight, router_bias, top_k, forced=forced)
    y = naive_experts(x, idx, w, w1, w3, w2, beta, linear_beta)
    if shared is not None:
        sg, su, sd = shared
        y = y + naive_situ_and_mul(x @ sg.t(), x @ su.t(), beta, linear_beta) @ sd.t()
    return y, idx


# ------------------------------------------------------------------------------------------------------------ FP8
def _scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, inverse) of blocks whose largest magnitudes are amax (fp32): scale = amax / 448 dequantises,
    inverse = 448 / amax quantises (q = x * inverse rounded to nearest: one division a block, not one an element),
    both with amax floored at 448 * 2^-126 so that the inverse stays finite; (1, 1) for an all-zero block."""
    floored = amax.clamp_min(AMAX_FLOOR)
    one = torch.ones_like(amax)
    # a tensor numerator: `448 / t` is torch's __rtruediv__, reciprocal(t) * 448 (two roundings, not IEEE's one)
    inverse = torch.full_like(floored, FP8_MAX) / floored
    return torch.where(amax > 0, floored / FP8_MAX, one), torch.where(amax > 0, inverse, one)


def naive_quant_rows(x: torch.Tensor, block: int = QUANT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K % block == 0) -> (q float8_e4m3fn [M, K], scale fp32 [M, K / block]); x ~ q * scale per block
    (`_scales`)."""
    M, K = x.shape
    blocks = x.float().view(M, K // block, block)
    scale, inverse = _scales(blocks.abs().amax(-1))
    q = (blocks * inverse[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(M, K), scale


def naive_quant_weight(w: torch.Tensor, block: int = QUANT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, N, K] (both % block) -> (q [E, N, K] e4m3, scale fp32 [E, N / block, K / block]), 128 x 128 blocks."""
    E, N, K = w.shape
    blocks = w.float().view(E, N // block, block, K // block, block)
    scale, inverse = _scales(blocks.abs().amax(dim=(2, 4)))
    q = (blocks * inverse[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(E, N, K), scale


def naive_dequant_rows(q: torch.Tensor, scale: torch.Tensor, block: int = QUANT_BLOCK) -> torch.Tensor:
    M, K = q.shape
    return (q.float().view(M, K // block, block) * scale[..., None]).view(M, K)


def naive_dequant_weight(q: torch.Tensor, scale: torch.Tensor, block: int = QUANT_BLOCK) -> torch.Tensor:
    E, N, K = q.shape
    return (q.float().view(E, N // block, block, K // block, block) * scale[:, :, None, :, None]).view(E, N, K)


def naive_quant_token_blocks(x: torch.Tensor, offsets: torch.Tensor, block: int = QUANT_BLOCK
                             ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """x [P, C] expert-sorted rows -> per expert e: (q e4m3 [C, n_e 128], scale fp32 [C, n_e]), n_e = its blocks of
    `block` rows (the last one zero-padded): x_e^T quantised in block x 1 blocks along the tokens."""
    out = []
    for e in range(offsets.numel() - 1):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        n = -(-(hi - lo) // block)
        xe = torch.zeros(n * block, x.shape[1], dtype=torch.float32, device=x.device)
        xe[:hi - lo] = x[lo:hi].float()
        q, s = naive_quant_rows(xe.t().contiguous(), block)  # rows = channels: 1 x block along the tokens
        out.append((q, s))
    return out


def naive_wgrad_fp8(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """sum over expert e's rows of a^T b from token-block-quantised operands, in fp32: a [P, M], b [P, N] ->
    [E, M, N] (the FP8 wgrad: dW2 = dY^T H, dW13 = dGU^T X)."""
    qa, qb = naive_quant_token_blocks(a, offsets), naive_quant_token_blocks(b, offsets)
    E = offsets.numel() - 1
    out = torch.zeros(E, a.shape[1], b.shape[1], dtype=torch.float32, device=a.device)
    for e in range(E):
        (aq, a_s), (bq, b_s) = qa[e], qb[e]
        out[e] = naive_dequant_rows(aq, a_s) @ naive_dequant_rows(bq, b_s).t()
    return out


def naive_experts_fp8(z: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, w1, w3, w2, beta: float = 4.0,
                      linear_beta: float = 25.0) -> torch.Tensor:
    """The FP8 forward: permuted activations and H quantised 1 x 128, weights 128 x 128, GEMMs on the dequantised
    values in fp32 (what the e4m3 tensor-core GEMM computes, up to accumulation order)."""
    order, pos, offsets = naive_permutation(idx, w1.shape[0])
    xq, xs = naive_quant_rows(naive_permute(z, order, idx.shape[1]))
    xp = naive_dequant_rows(xq, xs)
    d1, d3, d2 = (naive_dequant_weight(*naive_quant_weight(t)) for t in (w1, w3, w2))
    parts = []
    for e in range(w1.shape[0]):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        g, u = (xp[lo:hi] @ d1[e].t()).to(z.dtype), (xp[lo:hi] @ d3[e].t()).to(z.dtype)
        hq, hs = naive_quant_rows(naive_situ_and_mul(g.float(), u.float(), beta, linear_beta))
        parts.append((naive_dequant_rows(hq, hs) @ d2[e].t()).to(z.dtype))
    y = torch.cat(parts) if parts else z.new_zeros(0, w2.shape[1])
    return naive_combine(y, pos, w, z.dtype)


# ---------------------------------------------------------------------------------------------------------- MXFP4
def naive_dequant_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
                        ) -> torch.Tensor:
    """compressed-tensors `mxfp4-pack-quantized`: packed uint8 [out, in / 2] (element 2i in the low nibble, 2i + 1
    in the high one; E2M1: sign bit 3, magnitude code bits 0-2), scales uint8 E8M0 [out, in / 32] (2^(s - 127))
    -> [out, in] in `dtype` (exact: every E2M1 value times a power of two is representable in bf16)."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"packed, scales: expected uint8, got {packed.dtype}, {scales.dtype}")
    out_f, half = packed.shape
    if scales.shape != (out_f, 2 * half // MXFP4_GROUP) or (2 * half) % MXFP4_GROUP:
        raise ValueError(f"scales: expected [{out_f}, {2 * half // MXFP4_GROUP}] for packed {tuple(packed.shape)}, "
                         f"got {tuple(scales.shape)}")
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(out_f, 2 * half).long()
    table = torch.tensor(E2M1_VALUES, device=packed.device)
    vals = table[codes & 7] * (1 - 2 * (codes >> 3)).float()
    scale = torch.exp2(scales.float() - 127.0).repeat_interleave(MXFP4_GROUP, dim=1)
    return (vals * scale).to(dtype)
