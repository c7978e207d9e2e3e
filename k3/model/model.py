"""Reference Kimi K3 (text) in plain PyTorch: KDA and gated-MLA layers (3:1), block Attention Residuals,
a dense first layer and latent MoE layers with SiTU. Parameter names follow the kimi_linear checkpoint
(`model.layers.N.self_attn.*`, `...block_sparse_moe.*`); experts are stacked (see `adapter.py`).

`forward(input_ids, state)` continues a batch from its decode state; any split of a sequence into `extend`
calls gives the logits of one full forward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from k3.config import K3Config
from k3.model import ops
from k3.model.attnres import attn_res, pseudo_query
from k3.model.kda import KimiDeltaAttention
from k3.model.mla import GatedMLA
from k3.model.moe import LatentMoE, SiTUMLP
from k3.model.norm import RMSNorm
from k3.model.state import CacheView, DenseCache, K3State


@dataclass
class K3Output:
    logits: torch.Tensor                      # [B, T, vocab]
    state: K3State | None                     # decode state after these tokens (None when use_cache=False)
    routed_experts: torch.Tensor | None       # [B, T, n_moe_layers, top_k] int64 expert ids


class K3DecoderLayer(nn.Module):
    def __init__(self, cfg: K3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.is_kda = cfg.is_kda_layer(layer_idx)
        self.self_attn = KimiDeltaAttention(cfg) if self.is_kda else GatedMLA(cfg)
        self.is_moe = cfg.is_moe_layer(layer_idx)
        if self.is_moe:
            self.block_sparse_moe = LatentMoE(cfg)
        else:
            self.mlp = SiTUMLP(cfg.hidden_size, cfg.intermediate_size, cfg.activation_situ_beta,
                               cfg.activation_situ_linear_beta)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.block = cfg.attn_res_block_size
        if self.block is not None:
            self.self_attention_res_proj = pseudo_query(cfg.hidden_size)
            self.self_attention_res_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.mlp_res_proj = pseudo_query(cfg.hidden_size)
            self.mlp_res_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, prefix: torch.Tensor, bank: list[torch.Tensor], cache: CacheView,
                forced: torch.Tensor | None):
        """prefix: running sum of the current block (the embedding before layer 0); bank: stored block rows.
        Returns (new prefix, bank, expert ids or None)."""
        if self.block is None:  # plain pre-norm residual stream
            h = prefix + self.self_attn(self.input_layernorm(prefix), cache, self.layer_idx)
            m, idx = self._ffn(self.post_attention_layernorm(h), forced)
            return h + m, bank, idx
        if bank:  # the mixture and the input norm in one op
            x = attn_res(bank, prefix, self.self_attention_res_proj, self.self_attention_res_norm,
                         self.input_layernorm)
        else:
            x = self.input_layernorm(prefix)
        starts_block = self.layer_idx % self.block == 0
        if starts_block:
            bank = [*bank, ops.attnres_bank_row(prefix)]
        a = self.self_attn(x, cache, self.layer_idx)
        prefix = a if starts_block else prefix + a
        x = attn_res(bank, prefix, self.mlp_res_proj, self.mlp_res_norm, self.post_attention_layernorm)
        m, idx = self._ffn(x, forced)
        return prefix + m, bank, idx

    def _ffn(self, x: torch.Tensor, forced: torch.Tensor | None):
        if self.is_moe:
            return self.block_sparse_moe(x, forced)
        return self.mlp(x), None


class K3Model(nn.Module):
    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(K3DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.attn_res_block_size is not None:
            self.output_attn_res_proj = pseudo_query(cfg.hidden_size)
            self.output_attn_res_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class K3ForCausalLM(nn.Module):
    def __init__(self, config: K3Config, init: bool = True) -> None:
        super().__init__()
        self.config = config
        self.model = K3Model(config)
        self.lm_head = ops.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.moe_layer_ids = config.moe_layer_ids
        if init:
            self.init_weights()

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Normal(0, std) for matrices and experts, ones for norms, zero pseudo-queries and router bias;
        KDA's A_log/dt_bias and short convs keep their layer-specific init."""
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("_res_proj.weight") or leaf == "e_score_correction_bias":
                p.zero_()
            elif "norm" in name.rsplit(".", 2)[-2] or "conv1d" in name or leaf in ("A_log", "dt_bias"):
                continue
            elif p.dim() >= 2:
                p.normal_(0.0, std)

    def forward(self, input_ids: torch.Tensor, state: K3State | CacheView | None = None, *,
                routed_experts: torch.Tensor | None = None, return_routed_experts: bool = False,
                use_cache: bool = True, check_ids: bool = True) -> K3Output:
        """input_ids [B, T] continuing `state` (None = from scratch): a K3State (not modified; the output holds
        the new state) or an engine's CacheView (written in place; output state None). routed_experts
        [B, T, n_moe, k] forces the routing of every MoE layer (Router Replay); -1 rows route freely."""
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids: expected [B, T] with T >= 1, got {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        cfg = self.config
        # (two host syncs on CUDA: `check_ids=False` from callers that range-checked the ids on the host -- the
        # engine, whose prompts are checked at submission and whose fed tokens are sampled or checked drafts)
        if check_ids and (int(input_ids.min()) < 0 or int(input_ids.max()) >= cfg.vocab_size):
            raise ValueError(f"input_ids: token ids must be in [0, {cfg.vocab_size}), "
                             f"got range [{int(input_ids.min())}, {int(input_ids.max())}]")
        if isinstance(state, K3State) and state.layers and state.batch_size != B:
            raise ValueError(f"state: batch size {state.batch_size} does not match input_ids batch {B}")
        if routed_experts is not None:
            want = (B, T, len(self.moe_layer_ids), cfg.num_experts_per_token)
            if tuple(routed_experts.shape) != want:
                raise ValueError(f"routed_experts: expected shape {want}, got {tuple(routed_experts.shape)}")
            free = routed_experts < 0
            if int(routed_experts.min()) < -1 or int(routed_experts.max()) >= cfg.num_experts:
                raise ValueError(f"routed_experts: expert ids must be in [0, {cfg.num_experts}) or -1 (route freely), "
                                 f"got range [{int(routed_experts.min())}, {int(routed_experts.max())}]")
            if bool((free.any(-1) != free.all(-1)).any()):
                raise ValueError("routed_experts: a token's ids in a layer must be all valid or all -1")
        dense = state is None or isinstance(state, K3State)
        cache = DenseCache(state, cfg.num_hidden_layers, B, input_ids.device, store=use_cache) if dense else state
        h = self.model.embed_tokens(input_ids)
        bank: list[torch.Tensor] = []
        routed = []
        for layer in self.model.layers:
            forced = None
            if routed_experts is not None and layer.is_moe:
                forced = routed_experts[:, :, len(routed)]
            h, bank, idx = layer(h, bank, cache, forced)
            if idx is not None:
                routed.append(idx)
        if bank:
            h = attn_res(bank, h, self.model.output_attn_res_proj, self.model.output_attn_res_norm, self.model.norm)
        else:
            h = self.model.norm(h)
        logits = self.lm_head(h)
        new_state = cache.result(T) if dense and use_cache else None
        routed_t = torch.stack(routed, dim=2) if (return_routed_experts and routed) else None
        return K3Output(logits, new_state, routed_t)

    def extend(self, input_ids: torch.Tensor, state: K3State | None = None, **kwargs) -> tuple[torch.Tensor, K3State]:
        """Continue `state` with input_ids [B, T]; returns (logits [B, T, vocab], new state). `state` is not
        modified (branch with `state.clone()` or simply reuse it)."""
        out = self.forward(input_ids, state, use_cache=True, **kwargs)
        return out.logits, out.state

    # checkpoint I/O lives in k3.model.adapter; thin wrappers here for the usual API
    def save_pretrained(self, path) -> None:
        from k3.model.adapter import save_pretrained
        save_pretrained(self, path)

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
                        ) -> "K3ForCausalLM":
        from k3.model.adapter import load_pretrained
        return load_pretrained(path, dtype=dtype, device=device)


def count_parameters(config: K3Config) -> dict[str, int]:
    """Total and active (per token) parameters, from a meta-device build (no memory, seconds for full K3)."""
    with torch.device("meta"):
        model = K3ForCausalLM(config, init=False)
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    inactive = routed - routed * config.num_experts_per_token // max(config.num_experts, 1)
    return {"total": total, "active": total - inactive}
