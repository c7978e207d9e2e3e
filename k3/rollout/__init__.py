"""Embedded rollout engine: continuous batching over K3, paged MLA KV + KDA state pools with a host tier, and an
RL-aware prefix cache scoped by (adapter id, policy version)."""
from k3.rollout.config import EngineConfig, PrefixMatch, RequestFailed
from k3.rollout.engine import Engine
from k3.rollout.radix import RadixTree
from k3.rollout.types import Completion, Prompt, SamplingParams

__all__ = ["Completion", "Engine", "EngineConfig", "Prompt", "PrefixMatch", "RadixTree", "RequestFailed", "SamplingParams"]
