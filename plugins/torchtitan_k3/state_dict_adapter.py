"""K3 state dicts <-> the published kimi_k3 / kimi_linear checkpoint names (`model.layers.N.self_attn.*`,
`...block_sparse_moe.experts.{e}.w{1,2,3}.weight`), through k3.model.adapter (one mapping for the whole project).

The TorchTitan model's own state dict is `K3ForCausalLM`'s (stacked experts `experts.w{1,2,3}`), so `to_hf` splits
experts and `from_hf` checks every name and shape against the model (errors name the tensors) before stacking."""
from __future__ import annotations

from typing import Any

import torch
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from k3.model import K3ForCausalLM
from k3.model.adapter import from_hf as k3_from_hf
from k3.model.adapter import to_hf as k3_to_hf


class K3StateDictAdapter(StateDictAdapter):
    def __init__(self, model_config, hf_assets_path: str | None) -> None:
        super().__init__(model_config, hf_assets_path)
        cfg = model_config.k3
        with torch.device("meta"):
            expected = K3ForCausalLM(cfg, init=False).state_dict()
        if cfg.tie_word_embeddings:
            expected.pop("lm_head.weight", None)
        self._expected = expected

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        state = dict(state_dict)
        if self.model_config.k3.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        return k3_to_hf(state)

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        state = k3_from_hf(hf_state_dict, self._expected)
        if self.model_config.k3.tie_word_embeddings:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        return state
