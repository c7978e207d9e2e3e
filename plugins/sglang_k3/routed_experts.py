"""Routed experts from SGLang for Router Replay (R3: `k3.rl.router_replay`).

SGLang records, with `--enable-return-routed-experts`, every MoE layer's top-k ids at its single capture site
(`layers/moe/topk.py::capture_routed_experts_if_allowed` -> `RoutedExpertsCapturer.capture(layer_id, ids)`, which a
K3 MoE reaches through SGLang's `TopK`), into a device buffer [tokens, num_hidden_layers, k] and from there, per
forward, into a host cache indexed by KV slot; a finished request returns its rows [T - 1, num_hidden_layers, k]
int32 (base64 in `meta_info["routed_experts"]`).

Two facts of that format a trainer must not misread, handled here:
- Both buffers start as zeros and the rows of layers that never capture (K3's dense first layer) stay as they
  started: expert 0 and "no MoE here" look the same. The registered AFTER hook on `RoutedExpertsCapturer.__init__`
  fills both with -1, R3's "not recorded" (the model then routes that (token, layer) freely), so a slot that was
  never captured can never replay expert 0.
- R3 wants [B, T', n_moe_layers, k] int64 over the MoE layers only (`K3Config.moe_layer_ids`):
  `router_replay_ids` selects those layers, pads the batch with -1 and validates with
  `k3.rl.router_replay.check_routed_experts`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from k3.config import K3Config
from k3.rl.router_replay import check_routed_experts

NOT_RECORDED = -1
CAPTURER_INIT = "sglang.srt.state_capturer.routed_experts.RoutedExpertsCapturer.__init__"


@dataclass(frozen=True)
class RoutedExpertsLayout:
    """How SGLang's per-token rows map onto R3's MoE-layer axis."""

    num_hidden_layers: int
    moe_layer_ids: tuple[int, ...]
    top_k: int
    num_experts: int

    @classmethod
    def from_config(cls, config: K3Config) -> "RoutedExpertsLayout":
        return cls(config.num_hidden_layers, tuple(config.moe_layer_ids), config.num_experts_per_token,
                   config.num_experts)


def _mark_unrecorded(result, self, *args, **kwargs):
    """AFTER hook: -1 (not recorded) instead of zeros in the capturer's buffers."""
    self.host_cache.buffer.fill_(NOT_RECORDED)
    self.device_cache.buffer.fill_(NOT_RECORDED)
    return result


def request_rows(meta_info_or_rows, layout: RoutedExpertsLayout) -> torch.Tensor:
    """One request's rows [T', num_hidden_layers, k] int32, from SGLang's `meta_info` (base64) or an array."""
    if isinstance(meta_info_or_rows, dict):
        from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

        flat = extract_routed_experts_from_meta_info({"meta_info": meta_info_or_rows})
        width = layout.num_hidden_layers * layout.top_k
        if flat.size % width:
            raise ValueError(f"meta_info['routed_experts']: {flat.size} ids are not whole rows of "
                             f"{layout.num_hidden_layers} layers x {layout.top_k}")
        return torch.from_numpy(np.array(flat, copy=True)).view(-1, layout.num_hidden_layers, layout.top_k)
    rows = torch.as_tensor(meta_info_or_rows)
    if rows.dim() != 3 or tuple(rows.shape[1:]) != (layout.num_hidden_layers, layout.top_k):
        raise ValueError(f"routed experts rows must be [T, {layout.num_hidden_layers}, {layout.top_k}], got "
                         f"{tuple(rows.shape)}")
    return rows


def router_replay_ids(requests: Sequence, layout: RoutedExpertsLayout, length: int,
                      config: K3Config | None = None) -> torch.Tensor:
    """R3's routed_experts [B, length, n_moe, k] int64 for `requests` (meta_infos or row arrays, one per sequence
    of the batch); sequences shorter than `length` are padded with -1 (not recorded)."""
    rows = [request_rows(r, layout) for r in requests]
    moe = torch.tensor(layout.moe_layer_ids, dtype=torch.long)
    out = torch.full((len(rows), length, len(moe), layout.top_k), NOT_RECORDED, dtype=torch.int64)
    for b, r in enumerate(rows):
        if r.shape[0] > length:
            raise ValueError(f"requests[{b}]: {r.shape[0]} recorded tokens exceed length={length}")
        out[b, : r.shape[0]] = r.index_select(1, moe).long()
    return check_routed_experts(out, len(rows), length, config, name="routed_experts")


_done = False


def register() -> None:
    global _done
    if _done:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(CAPTURER_INIT, _mark_unrecorded, HookType.AFTER)
    _done = True
