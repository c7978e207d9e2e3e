"""Routed experts for Router Replay through SGLang's own capture path: the real `TopK` (torch-native routing) ->
`capture_routed_experts_if_allowed` -> the real `RoutedExpertsCapturer` (device buffer -> host cache by KV slot)
-> `get_topk` over a real `ReqToTokenPool`, then `k3_sglang.routed_experts.router_replay_ids` into R3's format.

A K3-shaped layer stack (tiny preset: layer 0 dense, 1..7 MoE, 8 experts, top-2); only the model config the
capturer reads is a stand-in (it needs `hf_text_config.num_experts_per_tok` / `num_hidden_layers`, nothing else).
"""
import base64
from types import SimpleNamespace

import torch

from _sglang_helpers import load_k3_plugins, server_args

load_k3_plugins()

from sglang.srt.layers.moe.topk import TopK  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.state_capturer.routed_experts import RoutedExpertsCapturer, set_global_experts_capturer  # noqa: E402

from k3.config import K3Config  # noqa: E402
from k3_sglang.routed_experts import RoutedExpertsLayout, router_replay_ids  # noqa: E402

CONFIG = K3Config.preset("tiny")
LAYOUT = RoutedExpertsLayout.from_config(CONFIG)


def _capturer():
    model_config = SimpleNamespace(hf_text_config=SimpleNamespace(
        num_experts_per_tok=CONFIG.num_experts_per_token, num_hidden_layers=CONFIG.num_hidden_layers))
    return RoutedExpertsCapturer(model_config, num_tokens=64, max_running_requests=4, num_fused_shared_experts=0,
                                 device="cpu")


def _forward(capturer, topks, logits_by_layer, kv_slots):
    """One forward: each MoE layer's TopK routes (and captures); then SGLang's per-forward copy to the host."""
    hidden = torch.zeros(kv_slots.numel(), 4)
    for layer, topk in topks.items():
        topk.forward_native(hidden, logits_by_layer[layer])
    capturer.on_forward_end(SimpleNamespace(out_cache_loc=kv_slots, out_cache_loc_virtual=None), False, None)


def test_sglang_capture_reaches_router_replay_format():
    with server_args(enable_return_routed_experts=True, chunked_prefill_size=64, max_running_requests=4):
        capturer = _capturer()
        set_global_experts_capturer(capturer)
        try:
            topks = {layer: TopK(top_k=CONFIG.num_experts_per_token, layer_id=layer, renormalize=True)
                     for layer in CONFIG.moe_layer_ids}
            pool = ReqToTokenPool(size=4, max_context_len=32, device="cpu", enable_memory_saver=False)
            g = torch.Generator().manual_seed(0)
            lengths = (6, 4)
            slots = [torch.arange(1, 7), torch.arange(20, 24)]
            logits = {}
            for r, (n, s) in enumerate(zip(lengths, slots)):
                pool.req_to_token[r, :n] = s.to(pool.req_to_token.dtype)
                logits[r] = {layer: torch.randn(n, CONFIG.num_experts, generator=g) for layer in topks}
            # request 0 prefills, then request 1 (two forwards: slots of each land in the host cache)
            for r in range(2):
                _forward(capturer, topks, logits[r], slots[r])
            rows = [capturer.get_topk(r, lengths[r], pool) for r in range(2)]  # SGLang's T - 1 rows per request
        finally:
            set_global_experts_capturer(None)
    assert [x.shape[0] for x in rows] == [5, 3]
    assert (rows[0][:, 0] == -1).all()  # the dense layer reads "not recorded", not expert 0
    # as the detokenizer ships it: base64 of the int32 rows
    metas = [{"routed_experts": base64.b64encode(x.numpy().tobytes()).decode()} for x in rows]
    ids = router_replay_ids(metas, LAYOUT, length=5, config=CONFIG)
    assert ids.shape == (2, 5, len(CONFIG.moe_layer_ids), CONFIG.num_experts_per_token) and ids.dtype == torch.int64
    for r, n in enumerate(lengths):
        for j, layer in enumerate(CONFIG.moe_layer_ids):
            want = torch.topk(logits[r][layer][: n - 1], CONFIG.num_experts_per_token, dim=-1).indices
            assert torch.equal(ids[r, : n - 1, j].sort(-1).values, want.sort(-1).values)
    assert (ids[1, 3:] == -1).all()  # the shorter sequence's padding is "not recorded"


def test_a_slot_never_captured_is_not_recorded_and_bad_rows_are_refused():
    with server_args(enable_return_routed_experts=True, chunked_prefill_size=64, max_running_requests=4):
        capturer = _capturer()
    pool = ReqToTokenPool(size=2, max_context_len=8, device="cpu", enable_memory_saver=False)
    pool.req_to_token[0, :3] = torch.tensor([5, 6, 7], dtype=pool.req_to_token.dtype)
    rows = capturer.get_topk(0, 3, pool)  # nothing was ever forwarded into these slots
    assert (router_replay_ids([rows], LAYOUT, length=2, config=CONFIG) == -1).all()
    try:
        router_replay_ids([torch.zeros(2, CONFIG.num_hidden_layers, 3, dtype=torch.int32)], LAYOUT, length=2)
    except ValueError as e:
        assert "rows must be" in str(e)
    else:
        raise AssertionError("a row of the wrong top-k width was accepted")
