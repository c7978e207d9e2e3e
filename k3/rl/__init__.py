"""k3.rl: GSPO loss, KL estimators, off-policy corrections (importance masking, staleness), mismatch metrics."""
from .gspo import AGG_MODES, aggregate, group_advantages, gspo_loss
from .kl import KL_KINDS, kl_estimate, kl_per_token
from .off_policy import (
    DEFAULT_BAND,
    ImportanceWeights,
    Staleness,
    band_keep,
    filter_stale,
    importance_weights,
    mismatch_metrics,
)
from .router_replay import check_routed_experts, routing_diff

# The learner pulls in the model (k3.model, k3.lora): imported on first use so that `import k3.rl` stays light
# for plugins that only need the losses.
_LAZY = {"Batch": "learner", "Learner": "learner", "LearnerConfig": "learner"}


def __getattr__(name: str):
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AGG_MODES",
    "Batch",
    "DEFAULT_BAND",
    "ImportanceWeights",
    "KL_KINDS",
    "Learner",
    "LearnerConfig",
    "Staleness",
    "aggregate",
    "band_keep",
    "check_routed_experts",
    "filter_stale",
    "group_advantages",
    "gspo_loss",
    "importance_weights",
    "kl_estimate",
    "kl_per_token",
    "mismatch_metrics",
    "routing_diff",
]
