"""Policy loss `k3_gspo` for verl: verl's policy-loss signature mapped onto `k3.rl.gspo_loss`.

verl's built-in `gspo` (core_algos.compute_policy_loss_gspo) is GSPO-token without any pi_theta/pi_old mask and
keeps rejected tokens in the denominator. `k3_gspo` computes the same GSPO-token objective with k3's code and adds
IcePop/MIS-style masking of tokens whose pi_theta/pi_old ratio leaves a band (rejected tokens get no gradient and
leave the local denominators), optionally of whole sequences (geometric-mean ratio). With masking off it equals
verl's `gspo` (tests/plugins/verl_k3).

The band is read from the environment (verl's dataclass configs reject unknown keys), on every call:
  K3_GSPO_MASK      "low_high" ratio band, as verl's rollout_is_threshold strings (default "0.5_2.0"); "off" = none
  K3_GSPO_SEQ_MASK  "1" to also reject whole sequences whose geometric-mean ratio leaves the band (default "0")
"""
from __future__ import annotations

import os
from typing import Any

import torch
from verl.trainer.ppo.core_algos import register_policy_loss

from k3.rl import gspo_loss, kl_estimate

DEFAULT_MASK = "0.5_2.0"


def mask_settings() -> tuple[tuple[float, float] | None, bool]:
    """(band or None, seq_mask) from K3_GSPO_MASK / K3_GSPO_SEQ_MASK; ValueError naming the variable if malformed."""
    raw = os.environ.get("K3_GSPO_MASK", DEFAULT_MASK).strip().lower()
    band: tuple[float, float] | None = None
    if raw not in ("off", "none", ""):
        try:
            low, high = (float(x) for x in raw.split("_"))
        except ValueError:
            raise ValueError(f"K3_GSPO_MASK must be 'low_high' (e.g. '0.5_2.0') or 'off', got {raw!r}") from None
        band = (low, high)
    seq = os.environ.get("K3_GSPO_SEQ_MASK", "0").strip().lower()
    if seq not in ("0", "1", "true", "false", ""):
        raise ValueError(f"K3_GSPO_SEQ_MASK must be 0 or 1, got {seq!r}")
    return band, seq in ("1", "true")


@register_policy_loss("k3_gspo")
def compute_policy_loss_k3_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl policy loss: GSPO-token with k3 masking. Clip ranges from `config.clip_ratio_low/high` (fallback
    `clip_ratio`), aggregation `loss_agg_mode` with verl's global batch info, `rollout_is_weights` applied per token."""
    if config is None:
        raise ValueError("k3_gspo needs the actor config (clip_ratio_low / clip_ratio_high)")
    eps_low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    eps_high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    info = dict(getattr(config, "global_batch_info", None) or {})
    dp_size = info.get("dp_size") or 1
    num_tokens, num_seqs = info.get("batch_num_tokens"), info.get("global_batch_size")
    if dp_size > 1 and (num_tokens is None if loss_agg_mode == "token-mean" else num_seqs is None):
        raise ValueError(f"k3_gspo: dp_size={dp_size} needs verl's global batch counts for {loss_agg_mode}")
    band, seq_mask = mask_settings()
    loss, m = gspo_loss(
        log_prob,
        old_log_prob,
        advantages,
        response_mask,
        eps_low,
        eps_high,
        token_level=True,
        policy_band=band,
        seq_mask=seq_mask,
        token_weights=rollout_is_weights,
        agg=loss_agg_mode,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        scale=dp_size,
        horizon=info.get("loss_scale_factor"),
        allow_empty=True,
    )
    mask = response_mask.bool()
    metrics = {
        "actor/pg_clipfrac": m["clip_frac"],
        "actor/ppo_kl": m["ppo_kl"],
        "actor/pg_clipfrac_lower": 0.0,  # no dual clip in GSPO (as verl's gspo)
        "actor/k3_masked_frac": m["masked_frac"],
        "actor/k3_seq_masked_frac": m["seq_masked_frac"],
        "actor/k3_seq_ratio_max": m["seq_ratio_max"],
        "actor/k3_seq_ratio_min": m["seq_ratio_min"],
    }
    if bool(mask.any()):
        # k3 estimate of KL(pi_old || pi_theta) per token: samples come from pi_old.
        metrics["actor/k3_policy_kl_k3"] = float(kl_estimate(old_log_prob.detach(), log_prob.detach(), "k3", mask))
    return loss, metrics
