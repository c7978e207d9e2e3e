"""`chunk_kda(..., return_intermediate_states=True)`: the state before every chunk of `chunk_size` tokens, as
fla-core returns it for prefix caching (SGLang's extra-buffer checkpoints), from what the forward saved."""
from __future__ import annotations

import torch


def intermediate_states(saved: tuple, k: torch.Tensor, plan: tuple, B: int, T: int, H: int, V: int,
                        chunk_size: int, state_v_first: bool) -> torch.Tensor:
    """h [B, NT, HV, K, V] (packed: [1, sum of the sequences' NT, ...] in sequence order; [..., V, K] with
    `state_v_first`) in k's dtype. The forward's per-chunk states (`Hc`, the state before each 64-token chunk,
    numbered class by class) are put in sequence order; for `chunk_size` 32 the state after each 64-token chunk's
    first 32 tokens is added between them, S_32 = e^{G_31} S + sum_{j<32} (k_j e^{G_31 - G_j})^T v'_j (fp32, from
    the saved in-chunk cumulative gate G and v' = U - W S, whose first 32 rows depend on those rows only), kept for
    the chunks that have more than 32 tokens."""
    Gc, Hc, VNc = saved[0], saved[7], saved[8]
    cu, cidx = plan[0], plan[1]
    HV, K = Hc.shape[1], k.shape[-1]
    seq, t = cidx[:, 0].long(), cidx[:, 1].long()
    order = torch.argsort(seq * (T + 1) + t)
    seq, t = seq[order], t[order]
    h = Hc[order, :, :K, :V]
    if chunk_size == 32:
        t0 = cu[seq] + t * 64
        rows = (t0[:, None] + torch.arange(32, device=k.device)).clamp(max=max(B * T - 1, 0))
        kk = k.reshape(-1, H, K)[rows].repeat_interleave(HV // H, dim=2).permute(0, 2, 1, 3).float()
        G = Gc[order, :, :32, :K]
        G31 = G[:, :, 31:32]
        S32 = h.float() * G31.exp().transpose(-1, -2) + \
            (kk * (G31 - G).exp()).transpose(-1, -2) @ VNc[order, :, :32, :V].float()
        keep = torch.stack([torch.ones_like(t0, dtype=torch.bool), cu[seq + 1] - t0 > 32], 1).flatten()
        h = torch.stack([h, S32.to(h.dtype)], 1).flatten(0, 1)[keep]
    h = h.reshape(B, h.shape[0] // B, HV, K, V)  # packed: B = 1
    return (h.transpose(-1, -2) if state_v_first else h).contiguous()
