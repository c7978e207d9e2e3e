"""Spec of the per-query MLA attention (`k3_kernels.mla_decode.query_attention`): query (b, t) attends to the keys
`key_index[b, t, :key_count[b, t]]` of row b, in that order, and nothing else:

    s_j = (q_nope . k_nope[idx_j] + q_pe . k_pe[idx_j]) * scale;   out = sum_j softmax(s)_j v[idx_j]

A decode step (one query, its row's keys 0..n-1), a chain verify's query t (keys 0..past+t) and a token-tree node
(the prefix, then its ancestors, in position order) are the same computation over the same logical key sequence."""
from __future__ import annotations

import torch


def naive_query_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor,
                          v: torch.Tensor, key_index: torch.Tensor, key_count: torch.Tensor, scale: float
                          ) -> torch.Tensor:
    """q_nope [B, T, H, DN], q_pe [B, T, H, DR], k_nope [B, S, H, DN], k_pe [B, S, DR], v [B, S, H, DV],
    key_index [B, T, >= max count] (positions in [0, S)), key_count [B, T] (>= 1) -> [B, T, H, DV] fp64."""
    B, T, H, _ = q_nope.shape
    out = torch.zeros(B, T, H, v.shape[-1], dtype=torch.float64, device=q_nope.device)
    for b in range(B):
        for t in range(T):
            keys = key_index[b, t, :int(key_count[b, t])].long()
            s = torch.einsum("hd,shd->hs", q_nope[b, t].double(), k_nope[b, keys].double())
            s = s + torch.einsum("hd,sd->hs", q_pe[b, t].double(), k_pe[b, keys].double())
            out[b, t] = torch.einsum("hs,shd->hd", torch.softmax(s * scale, dim=-1), v[b, keys].double())
    return out
