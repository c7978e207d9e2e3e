"""Shared by the vLLM plugin tests: the tiny checkpoint, the engine settings, the prompts and the comparison with
the embedded engine (k3.rollout)."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.rollout import Engine
from k3.rollout import SamplingParams as K3Sampling

# vLLM's CPU KV cache (GiB): the tiny model needs little; the default (4 GiB) is too much beside other engines.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

MAX_MODEL_LEN = 1024
# Chunked prefill: prompts longer than this are prefilled in several steps.
MAX_BATCHED_TOKENS = 256
LOGPROB_TOL = 1e-4


def tiny_checkpoint(directory: Path, seed: int = 0) -> K3ForCausalLM:
    """The tiny preset, randomly initialised (AttnRes pseudo-queries and router bias non-zero, so they matter), saved
    by k3.model; returns the fp32 model."""
    torch.manual_seed(seed)
    model = K3ForCausalLM(K3Config.preset("tiny"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_res_proj.weight") or name.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.5)
    model.eval().save_pretrained(directory)
    return model


def rollout(path: Path):
    """The vLLM backend on the checkpoint: fp32, prefix caching and chunked prefill on."""
    from k3_vllm.rollout import VllmRollout, VllmRolloutConfig

    return VllmRollout(path, VllmRolloutConfig(max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=MAX_BATCHED_TOKENS,
                                               max_num_seqs=16))


def rand_tokens(n: int, seed: int, vocab: int = 512) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def mixed_prompts() -> list[list[int]]:
    """Ten prompts from 1 to 300 tokens (the longest is prefilled in two chunks)."""
    return [rand_tokens(n, 100 + i) for i, n in enumerate((1, 5, 17, 33, 64, 90, 129, 200, 257, 300))]


def greedy(max_tokens: int, **kw) -> K3Sampling:
    return K3Sampling(temperature=0.0, max_tokens=max_tokens, **kw)


def embedded(model: K3ForCausalLM, prompts, *, max_tokens: int, adapter_id: str | None = None):
    """Greedy completions of the embedded engine (no prefix cache: every prompt computed from scratch)."""
    engine = Engine(model, prefix_cache=False)
    return engine.generate(prompts, greedy(max_tokens, adapter_id=adapter_id))


def max_logprob_gap(ours, ref) -> float:
    """Tokens must be equal (asserted); the largest |log-prob difference| over all tokens."""
    worst = 0.0
    for i, (o, r) in enumerate(zip(ours, ref, strict=True)):
        assert o.token_ids == r.token_ids, f"completion {i}: {o.token_ids} != {r.token_ids}"
        worst = max([worst] + [abs(a - b) for a, b in zip(o.logprobs, r.logprobs)])
    return worst
