"""KL and train/rollout mismatch metrics for verl runs (values from `k3.rl`).

verl's trainer calls `verl.utils.debug.metrics.calculate_debug_metrics(batch)` (imported at call time in
`RayPPOTrainer.fit`) whenever the batch holds `rollout_log_probs` next to the actor's `old_log_probs`.
`install_mismatch_metrics` wraps it so the same call also reports k3's mismatch metrics under
`training/k3_mismatch/*`; verl's own keys are returned unchanged.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from k3.rl import kl_estimate, mismatch_metrics

from .loss import mask_settings


def kl_metrics(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Per-token k1/k2/k3 estimates of KL(pi || ref) over `mask` (tokens sampled from pi)."""
    lp, ref = log_prob.detach(), ref_log_prob.detach()
    return {kind: float(kl_estimate(lp, ref, kind, mask)) for kind in ("k1", "k2", "k3")}


def mismatch_metrics_from_batch(data: Any) -> dict[str, float]:
    """k3 mismatch metrics of a verl DataProto with `old_log_probs` (trainer) and `rollout_log_probs`.

    Keys: training/k3_mismatch/{k3_kl, max_abs_dlogp, mean_abs_dlogp, masked_frac (band of K3_GSPO_MASK)}.
    Returns {} when the batch lacks those tensors or has no response token.
    """
    batch = data.batch
    if "rollout_log_probs" not in batch.keys() or "old_log_probs" not in batch.keys():
        return {}
    trainer, rollout = batch["old_log_probs"], batch["rollout_log_probs"]
    if "response_mask" in batch.keys():
        mask = batch["response_mask"]
    else:
        mask = batch["attention_mask"][:, -trainer.shape[-1] :]
    mask = mask.bool()
    if not bool(mask.any()):
        return {}
    band, _ = mask_settings()
    out = mismatch_metrics(trainer, rollout, mask, band=band)
    return {f"training/k3_mismatch/{k}": v for k, v in out.items()}


def install_mismatch_metrics() -> None:
    """Wrap verl's `calculate_debug_metrics` to add `mismatch_metrics_from_batch` (idempotent)."""
    import verl.utils.debug.metrics as debug_metrics

    original = debug_metrics.calculate_debug_metrics
    if getattr(original, "_k3_wrapped", False):
        return

    @functools.wraps(original)
    def calculate_debug_metrics(data: Any) -> dict:
        out = original(data)
        out.update(mismatch_metrics_from_batch(data))
        return out

    calculate_debug_metrics._k3_wrapped = True  # type: ignore[attr-defined]
    debug_metrics.calculate_debug_metrics = calculate_debug_metrics
