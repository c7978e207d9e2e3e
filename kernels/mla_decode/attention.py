"""Per-query MLA attention (spec: naive.py) in one Triton kernel: program (query, head) walks its key list
`key_index[b, t, :key_count[b, t]]` in BLOCK_S steps from the first key, with an online softmax in fp32. Every
query runs the same compiled kernel whatever the call holds: the integer arguments that vary between calls (the
key length S, the index width, the batch) are not specialised on (`do_not_specialize`), the head count and head
dims are constexpr, and the inputs are contiguous, so the loads' alignment (hence the layouts and the order of the
in-tile sums) is the same for a decode step, a chain verify and a token-tree node. cuBLAS-backed einsums pick their
kernels by T and the padded S, which is what made a [B, k+1] verify's attention differ from decoding in the last
bits."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3_kernels.launch import next_pow2

BLOCK_S = 32


@triton.jit(do_not_specialize=["S", "T", "SI", "scale"])
def _query_attention(qn_ptr, qp_ptr, kn_ptr, kp_ptr, v_ptr, idx_ptr, cnt_ptr, out_ptr, S, T, SI, scale,
                     H: tl.constexpr, DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr,
                     BDN: tl.constexpr, BDR: tl.constexpr, BDV: tl.constexpr, BLOCK: tl.constexpr):
    q = tl.program_id(0).to(tl.int64)      # b * T + t
    h = tl.program_id(1)
    b = q // T
    dn, dr, dv = tl.arange(0, BDN), tl.arange(0, BDR), tl.arange(0, BDV)
    qn = tl.load(qn_ptr + (q * H + h) * DN + dn, mask=dn < DN, other=0.).to(tl.float32)
    qp = tl.load(qp_ptr + (q * H + h) * DR + dr, mask=dr < DR, other=0.).to(tl.float32)
    n = tl.load(cnt_ptr + q)
    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([BDV], tl.float32)
    for s0 in range(0, n, BLOCK):
        j = s0 + tl.arange(0, BLOCK)
        jm = j < n
        pos = tl.load(idx_ptr + q * SI + j, mask=jm, other=0).to(tl.int64)
        row = b * S + pos                                                    # [BLOCK] key rows of batch row b
        kn = tl.load(kn_ptr + (row[:, None] * H + h) * DN + dn[None, :], mask=jm[:, None] & (dn < DN)[None, :],
                     other=0.).to(tl.float32)
        kp = tl.load(kp_ptr + row[:, None] * DR + dr[None, :], mask=jm[:, None] & (dr < DR)[None, :],
                     other=0.).to(tl.float32)
        s = (tl.sum(kn * qn[None, :], 1) + tl.sum(kp * qp[None, :], 1)) * scale
        s = tl.where(jm, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        vv = tl.load(v_ptr + (row[:, None] * H + h) * DV + dv[None, :], mask=jm[:, None] & (dv < DV)[None, :],
                     other=0.).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * vv, 0)
        m_i = m_new
    tl.store(out_ptr + (q * H + h) * DV + dv, acc / l_i, mask=dv < DV)


def causal_key_index(past: torch.Tensor, T: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row b's query t sees keys 0 .. past[b] + t (its past, then the call's tokens causally) ->
    (key_index [B, T, S] int32, key_count [B, T] int32)."""
    past = past.to(torch.int32)
    B = past.shape[0]
    index = torch.arange(S, dtype=torch.int32, device=past.device).expand(B, T, S).contiguous()
    count = past.view(B, 1) + 1 + torch.arange(T, dtype=torch.int32, device=past.device).view(1, T)
    return index, count.clamp(max=S)


def mask_key_index(visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """visible [B, T, S] bool -> (the visible positions of each query in increasing order, padded:
    key_index [B, T, S] int32, key_count [B, T] int32)."""
    S = visible.shape[-1]
    pos = torch.arange(S, dtype=torch.int32, device=visible.device)
    index = torch.where(visible, pos, torch.full_like(pos, S)).sort(dim=-1).values
    return index.clamp(max=S - 1).contiguous(), visible.sum(-1, dtype=torch.int32)


def _check(q_nope, q_pe, k_nope, k_pe, v, key_index, key_count) -> None:
    B, T, H, DN = q_nope.shape
    S = k_nope.shape[1]
    want = {"q_pe": (q_pe, (B, T, H, q_pe.shape[-1])), "k_nope": (k_nope, (B, S, H, DN)),
            "k_pe": (k_pe, (B, S, q_pe.shape[-1])), "v": (v, (B, S, H, v.shape[-1])),
            "key_count": (key_count, (B, T))}
    for name, (x, shape) in want.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"query_attention: {name} has shape {tuple(x.shape)}, expected {shape}")
    if key_index.dim() != 3 or tuple(key_index.shape[:2]) != (B, T):
        raise ValueError(f"query_attention: key_index has shape {tuple(key_index.shape)}, expected [{B}, {T}, n]")
    for name, x in (("q_pe", q_pe), ("k_nope", k_nope), ("k_pe", k_pe), ("v", v), ("key_index", key_index),
                    ("key_count", key_count)):
        if x.device != q_nope.device:
            raise ValueError(f"query_attention: {name} is on {x.device}, q_nope on {q_nope.device}")


def query_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor,
                    v: torch.Tensor, key_index: torch.Tensor, key_count: torch.Tensor, scale: float
                    ) -> torch.Tensor:
    """Shapes as naive_query_attention (key counts >= 1, indices in [0, S)) -> [B, T, H, DV] fp32 (inference)."""
    _check(q_nope, q_pe, k_nope, k_pe, v, key_index, key_count)
    B, T, H, DN = q_nope.shape
    S, DR, DV = k_nope.shape[1], q_pe.shape[-1], v.shape[-1]
    out = torch.empty(B, T, H, DV, dtype=torch.float32, device=q_nope.device)
    if B * T == 0 or H == 0:
        return out
    ins = [x.contiguous() for x in (q_nope, q_pe, k_nope, k_pe, v)]
    _query_attention[(B * T, H)](*ins, key_index.to(torch.int32).contiguous(), key_count.to(torch.int32).contiguous(),
                                 out, S, T, key_index.shape[-1], float(scale), H=H, DN=DN, DR=DR, DV=DV,
                                 BDN=next_pow2(DN), BDR=next_pow2(DR), BDV=next_pow2(DV), BLOCK=BLOCK_S,
                                 num_warps=4)
    return out
