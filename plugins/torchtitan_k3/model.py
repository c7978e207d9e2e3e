"""K3 as a TorchTitan model: `k3.model.K3ForCausalLM` itself (the same modules, parameter names and forward),
made a TorchTitan `BaseModel` so the trainer builds it from a `Config` on the meta device, initialises it after
sharding, counts its parameters and FLOPs, and calls it as `model(tokens, **extra_kwargs) -> logits`.

Parallelism is installed by `parallelize.py`: it swaps layer classes for their context-parallel / expert-parallel
subclasses (`context_parallel.py`, `expert_parallel.py`) and records the process groups on the model."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torchtitan.protocols.model import BaseModel
from torchtitan.protocols.module import Module

from k3.config import K3Config
from k3.lora import LoRAConfig
from k3.model import K3ForCausalLM, count_parameters
from k3.model.kda import KimiDeltaAttention

from .lora import attach_lora, reset_lora


class K3TitanModel(BaseModel, K3ForCausalLM):
    """`K3ForCausalLM` with TorchTitan's model protocol; its state dict is `K3ForCausalLM`'s (stacked experts)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        k3: K3Config = field(default_factory=lambda: K3Config.preset("tiny"))
        init_std: float = 0.02
        """Normal(0, init_std) for matrices and experts (k3.model's init_weights)."""
        lora: LoRAConfig | None = None
        """A k3.lora adapter on these targets, the base frozen (lora.py)."""

        def update_from_config(self, *, config, **kwargs) -> None:
            seq_len = config.training.seq_len
            if not isinstance(seq_len, int) or seq_len < 1:
                raise ValueError(f"training.seq_len: must be a positive integer, got {seq_len!r}")

        def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
            return nparams_and_flops(self.k3, seq_len)

    def __init__(self, config: Config) -> None:
        config.k3.validate()
        K3ForCausalLM.__init__(self, config.k3, init=False)
        self.init_std = config.init_std
        self.cp_group = None     # set by parallelize_k3 when context parallelism is on
        if config.k3.attn_res_block_size is not None:
            # layer 0's attention input mixes an empty bank (k3.model skips the mixture there): these two weights
            # never receive a gradient, and an optimizer state that exists for some parameters only would not
            # round-trip through a DCP checkpoint; they are frozen (kept in the state dict).
            first = self.model.layers[0]
            for p in (first.self_attention_res_proj.weight, first.self_attention_res_norm.weight):
                p.requires_grad_(False)
        if config.lora is not None:
            attach_lora(self, config.lora)

    # ------------------------------------------------------------------ TorchTitan protocol
    def verify_module_protocol(self) -> None:
        """The layers are k3.model's own modules (one definition of K3), not TorchTitan `Module`s; anything else
        (a converter or wrapper that left a foreign module) is reported by name."""
        foreign = [f"{fqn!r} ({type(m).__module__}.{type(m).__name__})" for fqn, m in self.named_modules()
                   if not isinstance(m, Module) and not _is_k3_module(m)]
        if foreign:
            raise RuntimeError("modules neither TorchTitan Modules nor k3.model layers: " + ", ".join(foreign))

    def init_states(self, *, buffer_device: torch.device | None = None) -> None:
        """k3.model's initialisation, valid on sharded (DTensor) parameters after `to_empty`: the layer-specific
        KDA parameters with the distributions of `KimiDeltaAttention.__init__`, then `K3ForCausalLM.init_weights`."""
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, KimiDeltaAttention):
                    _reset_kda(m)
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):  # every RMSNorm weight (k3.model builds them as ones)
                    p.fill_(1.0)
            K3ForCausalLM.init_weights(self, std=self.init_std)
            if getattr(self, "lora", None) is not None:
                reset_lora(self.lora)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                routed_experts: torch.Tensor | None = None, attention_masks=None) -> torch.Tensor:
        """tokens [B, T] (this rank's contiguous shard under context parallelism) -> logits [B, T, vocab].
        `positions` and `attention_masks` are TorchTitan's dataloader keys (K3 is NoPE and causal: unused);
        `routed_experts` [B, T_full, n_moe, k] replays recorded routings (Router Replay; -1 rows route freely)."""
        if routed_experts is not None and self.cp_group is not None:
            routed_experts = _cp_local_slice(routed_experts, tokens.shape[1], self.cp_group)
        return K3ForCausalLM.forward(self, tokens, None, routed_experts=routed_experts, use_cache=False).logits


def _is_k3_module(m: nn.Module) -> bool:
    mod = type(m).__module__
    return mod.startswith(("k3.", "k3_torchtitan.")) or type(m) in (nn.ModuleList, nn.ParameterDict,
                                                                      nn.Embedding, nn.Conv1d, nn.Module)


def _cp_local_slice(routed: torch.Tensor, local_len: int, group) -> torch.Tensor:
    import torch.distributed as dist

    rank = dist.get_rank(group)
    full = local_len * dist.get_world_size(group)
    if routed.shape[1] != full:
        raise ValueError(f"routed_experts: expected the full sequence ({full} tokens) along dim 1 under context "
                         f"parallelism, got shape {tuple(routed.shape)}")
    return routed[:, rank * local_len:(rank + 1) * local_len]


@torch.no_grad()
def _reset_kda(m: KimiDeltaAttention) -> None:
    """The distributions of KimiDeltaAttention.__init__ (A_log: zeros for the safe gate, log U(1, 16) otherwise;
    dt_bias: inverse softplus of log-uniform [1e-3, 1e-1]; short convs: nn.Conv1d's default), in place."""
    if m.lower_bound is not None:
        m.A_log.zero_()
    else:
        m.A_log.uniform_(1, 16).log_()
    dt = m.dt_bias
    dt.uniform_(math.log(1e-3), math.log(1e-1)).exp_().clamp_(min=1e-4)
    dt.copy_(dt + torch.log(-torch.expm1(-dt)))
    for conv in (m.q_conv1d, m.k_conv1d, m.v_conv1d):
        nn.init.kaiming_uniform_(conv.weight, a=math.sqrt(5))


def nparams_and_flops(cfg: K3Config, seq_len: int) -> tuple[int, int]:
    """(total parameters, training FLOPs per token). Parameters: `k3.model.count_parameters` (a meta build).
    FLOPs: 6 x active non-embedding parameters (forward + backward GEMMs) + causal MLA attention
    (QK^T and PV over seq_len/2 keys on average: 6 H (qk + v) T per layer, TorchTitan's convention) + the KDA
    recurrence (4 K V multiply-adds per head and token for decay, k^T S, the rank-1 update and q S: 24 H K V)."""
    counts = count_parameters(cfg)
    embedding = cfg.vocab_size * cfg.hidden_size
    n_mla = sum(1 for i in range(cfg.num_hidden_layers) if not cfg.is_kda_layer(i))
    n_kda = cfg.num_hidden_layers - n_mla
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    mla = 6 * n_mla * cfg.num_attention_heads * (qk + cfg.v_head_dim) * seq_len
    kda = 24 * n_kda * cfg.kda_num_heads * cfg.kda_head_dim * cfg.kda_head_dim
    return counts["total"], 6 * (counts["active"] - embedding) + mla + kda
