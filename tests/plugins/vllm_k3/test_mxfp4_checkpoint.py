"""A checkpoint in the published K3 format, routed experts MXFP4 (compressed-tensors `weight_packed` +
`weight_scale`) and its `quantization_config` in config.json, served by a real vLLM engine: vLLM hands the packed
tensors to k3_vllm's `load_weights`, which dequantises them (k3.model.adapter.from_hf), and the engine's greedy
tokens and log-probs equal the embedded engine's on the same file. Its own engine (start ~40 s on 2 cores)."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from _helpers import LOGPROB_TOL, embedded, greedy, max_logprob_gap, mixed_prompts, rollout, tiny_checkpoint  # noqa: E402

from _mxfp4_checkpoints import store_experts_as_mxfp4  # noqa: E402
from k3.model.adapter import load_pretrained  # noqa: E402


def test_published_mxfp4_checkpoint_serves_as_the_embedded_engine(tmp_path):
    tiny_checkpoint(tmp_path)
    meant = store_experts_as_mxfp4(tmp_path, with_quantization_config=True)
    reference = load_pretrained(tmp_path).eval()
    experts = reference.state_dict()["model.layers.1.block_sparse_moe.experts.w1"]
    assert meant and (experts[0] == meant["model.layers.1.block_sparse_moe.experts.0.w1.weight"].float()).all()
    prompts = mixed_prompts()[:4]
    want = embedded(reference, prompts, max_tokens=8)
    backend = rollout(tmp_path)
    try:
        got = backend.generate(prompts, greedy(8))
    finally:
        backend.close()
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert max_logprob_gap(got, want) <= LOGPROB_TOL
