"""Gated MLA with NoPE (K3): low-rank q, a 512-d KV latent plus 64 shared "rope" dims that are never rotated,
and a sigmoid output gate: out = o_proj(attn * sigmoid(g_proj(x))).

Prefill/training decompress the latent ("MHA mode"); the cache holds only the latent (c_KV, k_pe)."""
from __future__ import annotations

import torch
from torch import nn

from k3.config import K3Config
from k3.model import ops
from k3.model.norm import RMSNorm
from k3.model.state import CacheView


class GatedMLA(nn.Module):
    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora = cfg.kv_lora_rank
        qk = self.nope + self.rope
        d = cfg.hidden_size
        if cfg.q_lora_rank is None:
            self.q_proj = ops.Linear(d, self.n_heads * qk, bias=False)
        else:
            self.q_a_proj = ops.Linear(d, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = ops.Linear(cfg.q_lora_rank, self.n_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = ops.Linear(d, self.kv_lora + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, cfg.rms_norm_eps)
        self.kv_b_proj = ops.Linear(self.kv_lora, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = ops.Linear(self.n_heads * self.v_dim, d, bias=False)
        self.g_proj = ops.Linear(d, self.n_heads * self.v_dim, bias=False) if cfg.mla_use_output_gate else None
        self.scale = qk ** -0.5

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x: torch.Tensor, cache: CacheView, layer: int) -> torch.Tensor:
        B, T, _ = x.shape
        H = self.n_heads
        q = self._query(x).view(B, T, H, self.nope + self.rope)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        c_kv, k_pe, past = cache.mla(layer, c_kv, k_pe)
        S = c_kv.shape[1]
        k_nope, v = self.kv_b_proj(c_kv).view(B, S, H, self.nope + self.v_dim).split([self.nope, self.v_dim], -1)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        visible = getattr(cache, "attention_mask", None)   # token-tree verify (k3.rollout.spec): [B, T, S] bool
        if visible is None:
            attn = ops.mla_attention(q_nope, q_pe, k_nope, k_pe, v, past, self.scale).to(x.dtype)
        else:   # each node sees the row's prefix and its own ancestors only
            attn = ops.mla_masked_attention(q_nope, q_pe, k_nope, k_pe, v, visible(S), self.scale).to(x.dtype)
        attn = attn.reshape(B, T, H * self.v_dim)
        if self.g_proj is not None:
            attn = attn * torch.sigmoid(self.g_proj(x))
        return self.o_proj(attn)

