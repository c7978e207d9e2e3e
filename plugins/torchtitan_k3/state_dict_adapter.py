"""K3 state dicts <-> the published kimi_k3 / kimi_linear checkpoint names (`model.layers.N.self_attn.*`,
`...block_sparse_moe.experts.{e}.w{1,2,3}.weight`), through k3.model.adapter (one mapping for the whole project).

The TorchTitan model's own state dict is `K3ForCausalLM`'s (stacked experts `experts.w{1,2,3}`), so `to_hf` splits
experts and `from_hf` checks every name and shape against the model (errors name the tensors) before stacking.

TorchTitan's `--checkpoint.initial_load_in_hf` path reads the file with DCP into the tensors `to_hf` returns, which
have the model's shapes; `A_log` is stored in other layouts that k3.model.adapter accepts (Kimi Linear's
[1, 1, H, 1], the published K3 checkpoint's F32[128] for its 96 heads). `get_hf_storage_reader` (the adapter's
extension point, as TorchTitan's quantized readers use it) returns `K3HFStorageReader`, which presents those
`A_log` entries to DCP in the model's [H] shape and reads them as k3.model.adapter does (the first H values).

The published checkpoint's routed experts are MXFP4 (compressed-tensors `weight_packed` + `weight_scale`):
`--checkpoint.initial_load_in_hf_quantized` gives `K3MXFP4StorageReader`, which shows DCP each pair as the bf16
`...weight` the model asks for and reads it dequantised (k3.model.adapter.dequantize_mxfp4_pair, the same values as
`k3.model.adapter.load_pretrained`); any shard of it is a slice of the dequantised tensor."""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint._hf_utils import _HFStorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from k3.model import K3ForCausalLM
from k3.model.adapter import A_LOG_STORED_LENGTHS, MXFP4_PACKED, MXFP4_SCALE, CheckpointError, dequantize_mxfp4_pair
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
        heads = {name: t.shape[0] for name, t in self._expected.items() if name.endswith(".A_log")}
        return K3MXFP4StorageReader(path, heads) if from_quantized else K3HFStorageReader(path, heads)


def _a_log_layout_ok(stored: tuple[int, ...], heads: int) -> bool:
    """A layout of A_log that k3.model.adapter reads for a model with `heads` KDA heads."""
    flat = stored[2] if len(stored) == 4 and (stored[0], stored[1], stored[3]) == (1, 1, 1) else (
        stored[0] if len(stored) == 1 else None)
    return flat in (heads, A_LOG_STORED_LENGTHS.get(heads))


class K3HFStorageReader(HuggingFaceStorageReader):
    """HuggingFaceStorageReader (torch.distributed.checkpoint.hf_storage, torch 2.13) that shows DCP each `A_log`
    stored in an accepted non-[H] layout as [H] and reads its first H values. Any other layout is left as stored,
    so DCP's own size check names the tensor. A checkpoint with MXFP4 weights is refused with the flag that reads
    it (K3MXFP4StorageReader)."""

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
        return self._map_mxfp4(metadata)

    def _map_mxfp4(self, metadata):
        packed = sorted(n for n in metadata.state_dict_metadata if n.endswith(MXFP4_PACKED))
        if packed:
            raise CheckpointError(f"{packed[0]} (and {len(packed) - 1} more): the checkpoint stores MXFP4 weights; "
                                  "load it with --checkpoint.initial_load_in_hf_quantized")
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


class K3MXFP4StorageReader(K3HFStorageReader):
    """K3HFStorageReader for checkpoints whose routed experts are MXFP4 (`X.weight_packed` uint8 [out, in / 2] +
    `X.weight_scale` E8M0 [out, in / 32], in one file): DCP sees `X.weight` as bf16 [out, in] and reads the slice
    it asks for from the dequantised tensor. A packed weight without its scales, or in another file than them, is
    a CheckpointError naming both, raised while reading the metadata (before any tensor is read)."""

    def _map_mxfp4(self, metadata):
        tensors, storage = metadata.state_dict_metadata, metadata.storage_data
        packed = {n[: -len(MXFP4_PACKED)] for n in tensors if n.endswith(MXFP4_PACKED)}
        problems = []
        for base in sorted(packed):
            p_meta, s_meta = tensors.get(base + MXFP4_PACKED), tensors.get(base + MXFP4_SCALE)
            if s_meta is None:
                problems.append(f"{base}{MXFP4_PACKED}: MXFP4 weight without its scales {base}{MXFP4_SCALE}")
                continue
            p_info = storage.pop(MetadataIndex(fqn=base + MXFP4_PACKED, offset=[0, 0]), None)
            s_info = storage.pop(MetadataIndex(fqn=base + MXFP4_SCALE, offset=[0, 0]), None)
            if p_info is None or s_info is None or p_info.relative_path != s_info.relative_path:
                problems.append(f"{base}{MXFP4_PACKED}, {base}{MXFP4_SCALE}: each pair must be stored whole, in one "
                                "file")
                continue
            del tensors[base + MXFP4_PACKED], tensors[base + MXFP4_SCALE]
            shape = torch.Size([p_meta.size[0], 2 * p_meta.size[1]])
            tensors[base + ".weight"] = TensorStorageMetadata(
                properties=TensorProperties(dtype=torch.bfloat16), size=shape,
                chunks=[ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=shape)])
            storage[MetadataIndex(fqn=base + ".weight", offset=[0, 0])] = _HFStorageInfo(
                relative_path=p_info.relative_path, shape=shape, dtype=torch.bfloat16)
        if problems:
            raise CheckpointError("checkpoint's MXFP4 tensors:\n  " + "\n  ".join(problems))
        return metadata

    def _process_read_request(self, f, req, planner) -> None:
        # decided from the file (only the coordinator reads metadata under a process group)
        fqn = req.storage_index.fqn
        base = fqn[: -len(".weight")] if fqn.endswith(".weight") else None
        if base is None or fqn in f.keys() or base + MXFP4_PACKED not in f.keys():
            return super()._process_read_request(f, req, planner)
        full = dequantize_mxfp4_pair(base, f.get_tensor(base + MXFP4_PACKED), f.get_tensor(base + MXFP4_SCALE))
        piece = full[tuple(slice(o, o + n) for o, n in zip(req.storage_offsets, req.lengths))]
        target = planner.resolve_tensor(req).detach()
        target.copy_(piece)
        planner.commit_tensor(req, target)
