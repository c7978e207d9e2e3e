"""Off-policy corrections: trainer/rollout importance weights with band masking, mismatch metrics, staleness.

The rollout engine samples with mu (behaviour log-probs `rollout_logp`); the trainer recomputes the same tokens
under the same weights (`trainer_logp`, pi_old). Per token w_t = pi_old(y_t) / mu(y_t).

* Token masking (IcePop, Ant Group Ring-1T 2025; MIS, Liu, Li et al. "When Speed Kills Stability" 2025):
  a token whose w_t leaves [low, high] is rejected: it gets no gradient and leaves the loss denominator
  (slime PR #657). Kept tokens are weighted by w_t (token level) or by the sequence's geometric-mean ratio.
* Sequence masking (Geo-MIS): a sequence whose geometric-mean ratio exp(mean_t log w_t) leaves the band is
  rejected whole.
* Staleness: a sequence sampled by a policy `lag` versions behind the learner is accepted when
  0 <= lag <= max_staleness (weighted by decay**lag) and rejected with a reason otherwise.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from . import _checks
from .kl import kl_per_token

DEFAULT_BAND: tuple[float, float] = (0.5, 2.0)  # slime PR #657 / MIS reject band


def band_keep(
    log_ratio: torch.Tensor, mask: torch.Tensor, band: tuple[float, float], seq_mask: bool = False
) -> torch.Tensor:
    """Tokens of `mask` whose ratio exp(log_ratio) lies in [low, high]; with `seq_mask`, also drop whole
    sequences whose geometric-mean ratio over `mask` leaves the band. Returns a bool [B, T] mask."""
    log_low = math.log(band[0]) if band[0] > 0 else -math.inf
    log_high = math.log(band[1])
    lr = log_ratio.detach()
    keep = mask & (lr >= log_low) & (lr <= log_high)
    if seq_mask:
        n = mask.sum(-1).clamp(min=1)
        seq_lr = torch.where(mask, lr, torch.zeros_like(lr)).sum(-1) / n
        seq_ok = (seq_lr >= log_low) & (seq_lr <= log_high)
        keep = keep & seq_ok[:, None]
    return keep


@dataclass
class ImportanceWeights:
    """Result of `importance_weights`: detached weights (0 at rejected tokens), the kept-token mask, metrics."""

    weights: torch.Tensor
    keep: torch.Tensor
    metrics: dict[str, float]


def importance_weights(
    trainer_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    response_mask: torch.Tensor,
    band: tuple[float, float] | None = DEFAULT_BAND,
    level: Literal["token", "sequence"] | None = "token",
    seq_mask: bool = False,
) -> ImportanceWeights:
    """Importance weights pi_old/mu between trainer and rollout policies, with IcePop/MIS band masking.

    `band=None` masks nothing. `level` picks the weight: "token" w_t, "sequence" the geometric mean of w_t over
    the kept tokens, None weight 1 (mask only). Weights and masks are detached (no gradient flows into them).
    Metrics: masked_frac (response tokens rejected), seq_masked_frac (sequences with no token left), is_weight_mean.
    """
    tl = _checks.token_tensor("trainer_logp", trainer_logp)
    rl = _checks.token_tensor("rollout_logp", rollout_logp, tl, "trainer_logp")
    mask = _checks.mask_tensor("response_mask", response_mask, tl, "trainer_logp")
    _checks.finite_at("trainer_logp", tl, mask)
    _checks.finite_at("rollout_logp", rl, mask)
    return _importance_weights(tl.detach(), rl.detach(), mask, _checks.band("band", band), level, seq_mask)


def _importance_weights(
    tl: torch.Tensor,
    rl: torch.Tensor,
    mask: torch.Tensor,
    band: tuple[float, float] | None,
    level: Literal["token", "sequence"] | None,
    seq_mask: bool,
) -> ImportanceWeights:
    """`importance_weights` on validated, detached inputs."""
    if level not in ("token", "sequence", None):
        raise ValueError(f"level must be 'token', 'sequence' or None, got {level!r}")
    log_w = torch.where(mask, tl - rl, torch.zeros_like(tl))
    keep = mask if band is None else band_keep(log_w, mask, band, seq_mask)
    if level == "token":
        w = torch.exp(log_w.clamp(-20.0, 20.0))
    elif level == "sequence":
        n = keep.sum(-1).clamp(min=1)
        w = torch.exp((torch.where(keep, log_w, torch.zeros_like(log_w)).sum(-1) / n).clamp(-20.0, 20.0))
        w = w[:, None].expand_as(log_w)
    else:
        w = torch.ones_like(log_w)
    w = torch.where(keep, w, torch.zeros_like(w))
    n_resp = int(mask.sum())
    n_keep = int(keep.sum())
    had = mask.any(-1)
    metrics = {
        "masked_frac": (n_resp - n_keep) / max(n_resp, 1),
        "seq_masked_frac": float((had & ~keep.any(-1)).sum()) / max(int(had.sum()), 1),
        "is_weight_mean": float(w.sum()) / max(n_keep, 1),
    }
    return ImportanceWeights(weights=w, keep=keep, metrics=metrics)


def mismatch_metrics(
    trainer_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    band: tuple[float, float] | None = None,
) -> dict[str, float]:
    """Train/rollout mismatch over the response tokens of `mask`.

    k3_kl: per-token mean of k3 with samples from the rollout policy, r = exp(trainer_logp - rollout_logp),
    i.e. an estimate of KL(pi_rollout || pi_trainer) per token. max_abs_dlogp / mean_abs_dlogp: |Δ log p|.
    With a band, masked_frac is the fraction of tokens whose ratio pi_trainer/pi_rollout leaves it.
    """
    tl = _checks.token_tensor("trainer_logp", trainer_logp)
    rl = _checks.token_tensor("rollout_logp", rollout_logp, tl, "trainer_logp")
    m = _checks.mask_tensor("mask", mask, tl, "trainer_logp")
    if not bool(m.any()):
        raise ValueError("mask selects no tokens: mismatch metrics are undefined")
    _checks.finite_at("trainer_logp", tl, m)
    _checks.finite_at("rollout_logp", rl, m)
    return _mismatch_metrics(tl.detach(), rl.detach(), m, _checks.band("band", band))


def _mismatch_metrics(
    tl: torch.Tensor, rl: torch.Tensor, m: torch.Tensor, band: tuple[float, float] | None
) -> dict[str, float]:
    """`mismatch_metrics` on validated, detached inputs with a non-empty mask."""
    zero = torch.zeros_like(tl)
    tl = torch.where(m, tl, zero)
    rl = torch.where(m, rl, zero)
    n = int(m.sum())
    d = (tl - rl).abs()
    out = {
        "k3_kl": float(kl_per_token(rl, tl, "k3").masked_fill(~m, 0.0).sum()) / n,
        "max_abs_dlogp": float(d.max()),
        "mean_abs_dlogp": float(d.sum()) / n,
    }
    if band is not None:
        out["masked_frac"] = 1.0 - int(band_keep(tl - rl, m, band).sum()) / n
    return out


@dataclass
class Staleness:
    """Result of `filter_stale`: keep [B] bool, weights [B] (0 where rejected), lag [B], reasons (None if kept)."""

    keep: torch.Tensor
    weights: torch.Tensor
    lag: torch.Tensor
    reasons: list[str | None]

    @property
    def rejected_frac(self) -> float:
        """Fraction of sequences rejected."""
        return 1.0 - float(self.keep.float().mean())


def filter_stale(
    policy_versions: torch.Tensor | Sequence[int],
    learner_version: int,
    max_staleness: int,
    decay: float = 1.0,
) -> Staleness:
    """Accept sequences whose sampling policy is 0..max_staleness versions behind the learner, weighted by
    decay**lag; reject older ones (and ones claiming a version ahead of the learner) with a reason each.

    Feed `weights` to `gspo_loss(seq_weights=...)`: weight 0 drops the sequence from the loss and its denominator.
    """
    v = torch.as_tensor(policy_versions)
    if v.dim() != 1 or v.numel() == 0:
        raise ValueError(f"policy_versions must be a non-empty 1-D sequence of ints, got shape {tuple(v.shape)}")
    if v.is_floating_point() or v.dtype == torch.bool:
        raise ValueError(f"policy_versions must be integers, got dtype {v.dtype}")
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    if not 0.0 < decay <= 1.0:
        raise ValueError(f"decay must be in (0, 1], got {decay}")
    lag = int(learner_version) - v.long()
    keep = (lag >= 0) & (lag <= max_staleness)
    decayed = torch.full(lag.shape, decay, dtype=torch.float32) ** lag.float()
    weights = torch.where(keep, decayed, torch.zeros(lag.shape))
    reasons: list[str | None] = []
    for ver, lg in zip(v.tolist(), lag.tolist()):
        if lg < 0:
            reasons.append(f"policy version {ver} is ahead of learner version {learner_version}")
        elif lg > max_staleness:
            reasons.append(
                f"policy version {ver} is {lg} versions behind learner version {learner_version} (max {max_staleness})"
            )
        else:
            reasons.append(None)
    return Staleness(keep=keep, weights=weights, lag=lag, reasons=reasons)
