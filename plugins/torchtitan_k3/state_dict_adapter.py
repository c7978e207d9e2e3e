"""K3 state dicts <-> the published kimi_k3 / kimi_linear checkpoint names (`model.layers.N.self_attn.*`,
`...block_sparse_moe.experts.{e}.w{1,2,3}.weight`), through k3.model.adapter (one mapping for the whole project).

The TorchTitan model's own state dict is `K3ForCausalLM`'s (stacked experts `experts.w{1,2,3}`), so `to_hf` splits
experts and `from_hf` checks every name and shape against the model (errors name the tensors) before stacking.

TorchTitan's `--checkpoint.initial_load_in_hf` path reads the file with DCP into the tensors `to_hf` returns, which
have the model's shapes; `A_log` is stored in other layouts that k3.model.adapter accepts (Kimi Linear's
[1, 1, H, 1], the published K3 checkpoint's F32[128] for its 96 heads). `get_hf_storage_reader` (the adapter's
extension point, as TorchTitan's quantized readers use it) returns `K3HFStorageReader`, which presents those
`A_log` entries to DCP in the model's [H] shape and reads them as k3.model.adapter does (the first H values)."""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from k3.model import K3ForCausalLM
from k3.model.adapter import A_LOG_STORED_LENGTHS
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

    def get_hf_storage_reader(self, path: str, from_quantized: bool = False) -> HuggingFaceStorageReader:
        if from_quantized:
            raise ValueError("checkpoint.initial_load_in_hf_quantized: K3 has no quantized checkpoint reader")
        heads = {name: t.shape[0] for name, t in self._expected.items() if name.endswith(".A_log")}
        return K3HFStorageReader(path, heads)


def _a_log_layout_ok(stored: tuple[int, ...], heads: int) -> bool:
    """A layout of A_log that k3.model.adapter reads for a model with `heads` KDA heads."""
    flat = stored[2] if len(stored) == 4 and (stored[0], stored[1], stored[3]) == (1, 1, 1) else (
        stored[0] if len(stored) == 1 else None)
    return flat in (heads, A_LOG_STORED_LENGTHS.get(heads))


class K3HFStorageReader(HuggingFaceStorageReader):
    """HuggingFaceStorageReader (torch.distributed.checkpoint.hf_storage, torch 2.13) that shows DCP each `A_log`
    stored in an accepted non-[H] layout as [H] and reads its first H values. Any other layout is left as stored,
    so DCP's own size check names the tensor."""

    def __init__(self, path: str, a_log_heads: dict[str, int]) -> None:
        super().__init__(path)
        self.a_log_heads = a_log_heads

    def read_metadata(self):
        metadata = super().read_metadata()
        for fqn, heads in self.a_log_heads.items():
            meta = metadata.state_dict_metadata.get(fqn)
            if meta is None or tuple(meta.size) == (heads,) or len(meta.chunks) != 1:
                continue
            stored = tuple(meta.size)
            if not _a_log_layout_ok(stored, heads):
                continue
            meta.size = torch.Size([heads])
            meta.chunks = [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([heads]))]
            info = metadata.storage_data.pop(MetadataIndex(fqn=fqn, offset=[0] * len(stored)))
            metadata.storage_data[MetadataIndex(fqn=fqn, offset=[0])] = info
        return metadata

    def _process_read_request(self, f, req, planner) -> None:
        # decided from the file, not from read_metadata (under a process group only the coordinator reads metadata)
        fqn = req.storage_index.fqn
        heads = self.a_log_heads.get(fqn)
        if heads is None or tuple(f.get_slice(fqn).get_shape()) == (heads,):
            return super()._process_read_request(f, req, planner)
        values = f.get_tensor(fqn).reshape(-1)[:self.a_log_heads[fqn]]
        target = planner.resolve_tensor(req).detach()
        target.copy_(values[req.storage_offsets[0]:req.storage_offsets[0] + req.lengths[0]])
        planner.commit_tensor(req, target)
