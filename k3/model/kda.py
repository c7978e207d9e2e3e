"""Kimi Delta Attention token mixer (K3 / Kimi Linear, report Eq. 10):

    q, k = L2Norm(SiLU(ShortConv(W_q/k x)));  v = SiLU(ShortConv(W_v x))
    g = safe gate of f_b(f_a(x))  (lower_bound * sigmoid(exp(A_log) (f + dt_bias)))
    beta = sigmoid(b_proj x)
    o = o_proj( RMSNorm_head(KDA(q, k, v, g, beta)) * weight * sigmoid(g_proj x) )   (full-rank output gate)
"""
from __future__ import annotations

import math

import torch
from torch import nn

from k3.config import K3Config
from k3.model import ops
from k3.model.state import CacheView

# Up to this many new tokens the recurrent (decode) path is used; above it the chunked path.
RECURRENT_MAX_TOKENS = 16


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        H, K = cfg.kda_num_heads, cfg.kda_head_dim
        d, W = cfg.hidden_size, cfg.conv_kernel_size
        self.n_heads, self.head_dim, self.conv_size = H, K, W
        self.lower_bound = cfg.gate_lower_bound
        self.eps = cfg.rms_norm_eps
        proj = H * K
        self.q_proj = ops.Linear(d, proj, bias=False)
        self.k_proj = ops.Linear(d, proj, bias=False)
        self.v_proj = ops.Linear(d, proj, bias=False)
        self.q_conv1d = nn.Conv1d(proj, proj, W, groups=proj, bias=False)
        self.k_conv1d = nn.Conv1d(proj, proj, W, groups=proj, bias=False)
        self.v_conv1d = nn.Conv1d(proj, proj, W, groups=proj, bias=False)
        self.f_a_proj = ops.Linear(d, K, bias=False)
        self.f_b_proj = ops.Linear(K, proj, bias=False)
        self.b_proj = ops.Linear(d, H, bias=False)
        if cfg.linear_attn_config.get("use_full_rank_gate", True):
            self.g_proj = ops.Linear(d, proj, bias=False)
        else:
            self.g_a_proj = ops.Linear(d, K, bias=False)
            self.g_b_proj = ops.Linear(K, proj, bias=False)
        # Safe gate: A_log zero-init (FLA); default gate: log U(1, 16).
        self.A_log = nn.Parameter(torch.zeros(H) if self.lower_bound is not None else torch.empty(H).uniform_(1, 16).log())
        dt = torch.exp(torch.empty(proj).uniform_(math.log(1e-3), math.log(1e-1))).clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(K))
        self.o_proj = ops.Linear(proj, d, bias=False)

    def _output_gate(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "g_proj"):
            return self.g_proj(x)
        return self.g_b_proj(self.g_a_proj(x))

    def step_inputs(self, xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
                    conv: torch.Tensor | None, with_q: bool = True, roll: torch.Tensor | None = None):
        """The recurrence's inputs from the projections of x (xq, xk, xv [B, T, H*K], f [B, T, H*K], b [B, T, H])
        and the short-conv windows `conv` [B, 3, H*K, W-1] (None: zeros) -> (q, k, v, g, beta, new windows), by
        `ops.kda_step_inputs`. Speculative commits (k3.rollout.spec) call it again on stored projections, at decode's
        shapes, to rebuild k, v, g, beta bitwise instead of storing them (`with_q=False`: q is None, its window
        only rolled; `roll` [B]: each row's windows rolled by its own accepted count, not by T)."""
        return ops.kda_step_inputs(xq, xk, xv, f, b, conv, (self.q_conv1d.weight, self.k_conv1d.weight,
                                                            self.v_conv1d.weight),
                                   self.A_log, self.dt_bias, self.lower_bound, with_q=with_q, roll=roll)

    def forward(self, x: torch.Tensor, cache: CacheView, layer: int) -> torch.Tensor:
        B, T, _ = x.shape
        H, K = self.n_heads, self.head_dim
        h0, conv = cache.kda(layer)
        xq, xk, xv = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        f, b = self.f_b_proj(self.f_a_proj(x)), self.b_proj(x)
        tree = getattr(cache, "kda_tree", None)   # token-tree verify (k3.rollout.spec): positions are tree nodes
        if tree is None:
            q, k, v, g, beta, windows = self.step_inputs(xq, xk, xv, f, b, conv)
        else:   # each node's conv window along its own path, its recurrence from its parent's state
            q, k, v, g, beta, windows = tree.step_inputs(self, xq, xk, xv, f, b, conv)
        record = getattr(cache, "record_kda_inputs", None)   # speculative verify (k3.rollout.spec): ReplaySSM inputs
        if record is not None:   # the projections only: the commit rebuilds k, v, g, beta with `step_inputs`
            record(layer, torch.stack([xq, xk, xv], dim=2), f, b)   # [B, T, 3, H*K], [B, T, H*K], [B, T, H]
        o, h = self.mix(q, k, v, g, beta, h0) if tree is None else tree.mix(q, k, v, g, beta, h0)
        gate = self._output_gate(x).view(B, T, H, K)
        o = ops.gated_rms_norm(o, gate, self.o_norm.weight, self.eps).reshape(B, T, H * K)
        cache.set_kda(layer, h, windows)
        return self.o_proj(o)

    def mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            initial_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The recurrence over this call's tokens from `initial_state` -> (o [B, T, H, V], final state [B, H, K, V]).
        The hook context parallelism overrides (plugins/torchtitan_k3 passes states across ranks)."""
        kda = ops.kda_recurrent if q.shape[1] <= RECURRENT_MAX_TOKENS else ops.kda_chunk
        return kda(q, k, v, g, beta, initial_state=initial_state, output_final_state=True)
