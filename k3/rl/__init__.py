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

__all__ = [
    "AGG_MODES",
    "DEFAULT_BAND",
    "ImportanceWeights",
    "KL_KINDS",
    "Staleness",
    "aggregate",
    "band_keep",
    "filter_stale",
    "group_advantages",
    "gspo_loss",
    "importance_weights",
    "kl_estimate",
    "kl_per_token",
    "mismatch_metrics",
]
