"""K3 feed-forward blocks: SiTU MLP (dense layer 0 and the shared experts) and the latent MoE.

Latent MoE (K3 Eq. 11): z = W_down x; u = sum_{i in TopK(x)} p_i E_i(z); y = shared(x) + W_up RMSNorm(u).
Router (noaux_tc): s = sigmoid(W_r x) in fp32; the correction bias only affects selection; weights are s over the
selected set, renormalised and scaled. With `routed_experts` given (Router Replay) selection is forced and weights
are recomputed from the current router over the given experts; tokens whose ids are all -1 route freely (e.g.
prompt tokens a rollout engine served from its prefix cache without recording their routing).
"""
from __future__ import annotations

import torch
from torch import nn

from k3.config import K3Config
from k3.model import ops
from k3.model.norm import RMSNorm
from k3_kernels.elementwise import position_invariant


class SiTUMLP(nn.Module):
    def __init__(self, d: int, inter: int, beta: float, linear_beta: float) -> None:
        super().__init__()
        self.gate_proj = ops.Linear(d, inter, bias=False)
        self.up_proj = ops.Linear(d, inter, bias=False)
        self.down_proj = ops.Linear(inter, d, bias=False)
        self.beta, self.linear_beta = beta, linear_beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.situ_and_mul(self.gate_proj(x), self.up_proj(x), self.beta, self.linear_beta))


class Router(nn.Module):
    """Checkpoint names: `gate.weight [E, d]`, `gate.e_score_correction_bias [E]`."""

    def __init__(self, d: int, n_experts: int, top_k: int, renormalize: bool, scaling: float,
                 n_group: int, topk_group: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, d))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(n_experts), requires_grad=False)
        self.top_k, self.renormalize, self.scaling = top_k, renormalize, scaling
        self.n_group, self.topk_group = n_group, topk_group

    def forward(self, x: torch.Tensor, forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, d] -> (expert ids [N, k] int64, weights [N, k] fp32)."""
        if ops.fused_moe(x) and self.n_group == 1:  # the fused Triton router (same fp32 math, ties to the lowest id)
            return ops.moe_router(x.float().contiguous(), self.weight.float(), self.e_score_correction_bias.float(),
                                  self.top_k, self.renormalize, self.scaling, forced)
        scores = position_invariant(torch.sigmoid, ops.linear(x.float(), self.weight.float()))   # [N, E]: CPU tails
        if forced is None or bool((forced < 0).any()):
            sel = (scores + self.e_score_correction_bias.float()).detach()
            if self.n_group > 1:
                sel = self._mask_groups(sel)
            idx = torch.topk(sel, self.top_k, dim=-1, sorted=True).indices
            if forced is not None:  # rows of -1 are routed freely, the others replayed
                idx = torch.where(forced[:, :1] < 0, idx, forced.long())
        else:
            idx = forced.long()
        w = scores.gather(-1, idx)
        if self.renormalize:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * self.scaling

    def _mask_groups(self, sel: torch.Tensor) -> torch.Tensor:
        N, E = sel.shape
        grouped = sel.view(N, self.n_group, E // self.n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view(N, E)


class RoutedExperts(nn.Module):
    """Stacked expert weights `w1` (gate) [E, I, L], `w3` (up) [E, I, L], `w2` (down) [E, L, I] so the full K3
    builds on the meta device quickly; the checkpoint adapter splits them into `experts.{e}.w{1,2,3}.weight`."""

    def __init__(self, n_experts: int, latent: int, inter: int, beta: float, linear_beta: float) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, inter, latent))
        self.w3 = nn.Parameter(torch.empty(n_experts, inter, latent))
        self.w2 = nn.Parameter(torch.empty(n_experts, latent, inter))
        self.beta, self.linear_beta = beta, linear_beta

    def forward(self, z: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, ids_checked: bool = False) -> torch.Tensor:
        """z [N, L]; idx, w [N, k] -> sum_i w_i E_{idx_i}(z) [N, L]. `ids_checked`: idx is known to lie in [0, E)
        (the router's own top-k), so the fused kernels' range check, a host sync on CUDA, is skipped.

        Each (token, slot) output is written once (no scatter-add), then summed over slots in a fixed order:
        the result does not depend on the batch composition or on the device's atomics. With the fused kernels
        (`ops.fused_moe`) and no `project` override (adapters, expert-parallel shards) the grouped-GEMM kernels
        compute the same sum (k3_kernels.moe), with the same promises."""
        if ops.fused_moe(z) and "project" not in vars(self) and getattr(type(self), "project", None) is \
                RoutedExperts.project:
            return ops.moe_experts(z, idx, w, self.w1, self.w3, self.w2, self.beta, self.linear_beta,
                                   ids_checked=ids_checked)
        N, k = idx.shape
        out = z.new_zeros(N, k, z.shape[-1])
        flat = idx.reshape(-1)
        # unbind once: its backward writes one [E, ...] gradient, where indexing `w[e]` per expert would
        # allocate and add a zero-filled [E, ...] gradient for every expert used
        w1, w2, w3 = self.w1.unbind(0), self.w2.unbind(0), self.w3.unbind(0)
        for e in torch.unique(flat).tolist():
            pos = (flat == e).nonzero(as_tuple=True)[0]
            tok = pos // k
            ze = z[tok]
            h = ops.situ_and_mul(self.project("w1", e, tok, ze, w1[e]), self.project("w3", e, tok, ze, w3[e]),
                                 self.beta, self.linear_beta)
            out = out.index_put((tok, pos % k), self.project("w2", e, tok, h, w2[e]))
        return (out.float() * w[..., None]).sum(1).to(z.dtype)

    def project(self, which: str, expert: int, tok: torch.Tensor, x: torch.Tensor, weight: torch.Tensor
                ) -> torch.Tensor:
        """x @ weight.T for expert `expert`'s `which` ("w1" | "w3" | "w2") projection of the tokens `tok` (flat
        token indices). The hook point for per-expert adapters (k3.lora overrides it on an instance)."""
        return ops.linear(x, weight)


class LatentMoE(nn.Module):
    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        d, L = cfg.hidden_size, cfg.latent_size
        self.n_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_token
        self.gate = Router(d, cfg.num_experts, cfg.num_experts_per_token, cfg.moe_renormalize,
                           cfg.routed_scaling_factor, cfg.num_expert_group, cfg.topk_group)
        self.experts = RoutedExperts(cfg.num_experts, L, cfg.moe_intermediate_size, cfg.activation_situ_beta,
                                     cfg.activation_situ_linear_beta)
        self.shared_experts = (SiTUMLP(d, cfg.moe_intermediate_size * cfg.num_shared_experts, cfg.activation_situ_beta,
                                       cfg.activation_situ_linear_beta) if cfg.num_shared_experts > 0 else None)
        self.is_latent = cfg.routed_expert_hidden_size is not None
        if self.is_latent:
            self.routed_expert_down_proj = ops.Linear(d, L, bias=False)
            self.routed_expert_up_proj = ops.Linear(L, d, bias=False)
            self.routed_expert_norm = RMSNorm(L, cfg.rms_norm_eps) if cfg.latent_moe_use_norm else None

    def forward(self, x: torch.Tensor, forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, d]; forced expert ids [B, T, k] or None -> (y [B, T, d], expert ids [B, T, k])."""
        B, T, d = x.shape
        flat = x.reshape(B * T, d)
        if forced is not None:
            forced = forced.reshape(B * T, -1)
        idx, w = self.gate(flat, forced)
        z = self.routed_expert_down_proj(flat) if self.is_latent else flat
        # the router's own ids are in range; forced ones (Router Replay) keep the experts' check
        u = self.experts(z, idx, w, ids_checked=True) if forced is None else self.experts(z, idx, w)
        if self.is_latent:
            if self.routed_expert_norm is not None:
                u = self.routed_expert_norm(u)
            u = self.routed_expert_up_proj(u)
        y = u if self.shared_experts is None else u + self.shared_experts(flat)
        return y.view(B, T, d), idx.view(B, T, -1)
