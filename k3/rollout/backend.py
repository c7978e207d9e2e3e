"""Rollout backends: who generates the RL job's rollouts (the embedded engine, or a serving framework's engine
through its plugin), behind one interface the main job (and later plugins) use.

A backend takes k3's own request types (`Prompt`, `SamplingParams`) and returns k3's `Completion`s, receives the
policy's weights as k3.sync payloads (a full snapshot to start, XOR deltas after) and proves what it serves with a
digest of its weights in the published dtype. Framework-free: a framework's backend is named here by its import
path and imported only when selected (`load_backend`), so k3 never imports a framework."""
from __future__ import annotations

import hashlib
import importlib
from typing import Protocol, Sequence

import torch

from k3.rollout.types import Completion, Prompt, SamplingParams, checked_requests

#: `rollout.backend` values: "embedded" is k3.rollout.Engine in-process; the others live in plugins.
BACKENDS: dict[str, str | None] = {
    "embedded": None,
    "vllm": "k3_vllm.rollout:VllmRollout",
}


class RolloutBackend(Protocol):
    """What the RL loop needs from a rollout engine that holds its own copy of the policy. Built with
    `cls.launch(checkpoint_dir, max_model_len=..., seed=...)` (a k3.model checkpoint: the base weights), then
    `start_sync(full_payload, publish_dtype=..., lora=LoRAConfig | None, adapter_id=...)` gives it the policy."""

    version: int

    def start_sync(self, full_payload: bytes, *, publish_dtype: torch.dtype, lora=None,
                   adapter_id: str | None = None) -> int:
        """Serve the policy of a full k3.sync snapshot: every weight, or (lora) the adapter `adapter_id`."""
        ...

    def generate(self, prompts: Sequence[list[int]], sampling: SamplingParams | Sequence[SamplingParams]
                 ) -> list[Completion]:
        """One Completion per sample, prompt-major (prompt 0's n samples first)."""
        ...

    def apply_weight_payload(self, payload: bytes) -> int:
        """Apply a k3.sync payload (full snapshot or XOR delta) atomically and serve the new version (cached
        prefixes of older versions are never served again); a refused payload leaves the old version serving."""
        ...

    def weights_digest(self) -> str:
        """`state_digest` of the served policy tensors (in the published dtype)."""
        ...

    def cache_stats(self) -> dict:
        """At least `prompt_tokens` and `hit_tokens` (prompt tokens served from the prefix cache), cumulative."""
        ...

    def close(self) -> None:
        ...


def load_backend(name: str):
    """The backend class registered as `name` (imports its plugin now); "embedded" has none (the Engine is used)."""
    if name not in BACKENDS:
        raise ValueError(f"rollout.backend: unknown backend {name!r}; choose from {sorted(BACKENDS)}")
    target = BACKENDS[name]
    if target is None:
        return None
    module, _, attr = target.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise ValueError(f"rollout.backend: {name!r} needs its plugin ({module}) and framework installed "
                         f"(pip install 'k3-plugins[{name}]'): {e}") from e


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 over names, dtypes, shapes and raw bytes, in name order: equal digests = bitwise-equal states."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def checked_backend_requests(prompts, sampling, *, vocab_size: int, max_len: int,
                             adapter_ids: Sequence[str | None]) -> list[tuple[Prompt, SamplingParams]]:
    """`k3.rollout.types.checked_requests` for a backend serving `adapter_ids` with `max_model_len` = max_len."""
    def check_adapter(adapter_id, where):
        if adapter_id not in adapter_ids:
            raise ValueError(f"{where}: {adapter_id!r} is not served (served: {list(adapter_ids)})")
    return [(pr, sp) for pr, sp, _ in checked_requests(prompts, sampling, vocab_size=vocab_size, max_len=max_len,
                                                       limit="the backend's max_model_len",
                                                       check_adapter=check_adapter)]
