"""Schulman's KL estimators k1, k2, k3 (joschu.net/blog/kl-approx.html, 2020).

Tokens are sampled from pi (log-probs `logp`); with r = exp(ref_logp - logp) = ref(x)/pi(x):
k1 = -log r (unbiased, can be negative), k2 = (log r)^2 / 2 (biased, >= 0), k3 = (r - 1) - log r
(unbiased, >= 0, low variance). Each estimates KL(pi || ref) per token.
"""
from __future__ import annotations

from typing import Literal

import torch

from . import _checks

KLKind = Literal["k1", "k2", "k3"]
KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3")


def kl_per_token(logp: torch.Tensor, ref_logp: torch.Tensor, kind: KLKind = "k3") -> torch.Tensor:
    """Per-token estimator values [B, T] (no masking, no validation; differentiable in both inputs)."""
    log_r = ref_logp - logp
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r.square()
    if kind == "k3":
        # expm1 keeps r - 1 exact for small |log r| (the regime of interest: ~1e-3 mismatch).
        return torch.expm1(log_r) - log_r
    raise ValueError(f"kind must be one of {KL_KINDS}, got {kind!r}")


def kl_estimate(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    kind: KLKind = "k3",
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token mean over `mask` of Schulman's estimator `kind` of KL(pi || ref); a 0-dim tensor.

    `logp` are the sampled tokens' log-probs under pi, `ref_logp` under the reference, both [B, T];
    `mask` [B, T] (bool or 0/1) selects the tokens (all when None). Differentiable in `logp`
    (use as a KL penalty). Raises ValueError on mismatched shapes, an empty mask or NaN/inf at masked tokens.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"kind must be one of {KL_KINDS}, got {kind!r}")
    lp = _checks.token_tensor("logp", logp)
    ref = _checks.token_tensor("ref_logp", ref_logp, lp)
    m = torch.ones_like(lp, dtype=torch.bool) if mask is None else _checks.mask_tensor("mask", mask, lp)
    n = int(m.sum())
    if n == 0:
        raise ValueError("mask selects no tokens: the KL estimate is undefined")
    _checks.finite_at("logp", lp, m)
    _checks.finite_at("ref_logp", ref, m)
    # Padding outside the mask may be -inf/NaN: replace it before the math so no NaN reaches the gradient.
    lp = torch.where(m, lp, torch.zeros_like(lp))
    ref = torch.where(m, ref, torch.zeros_like(ref))
    per_tok = kl_per_token(lp, ref, kind)
    return torch.where(m, per_tok, torch.zeros_like(per_tok)).sum() / n
