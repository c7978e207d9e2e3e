"""GSPO (Zheng et al., arXiv 2507.18071) with off-policy corrections, loss aggregation and group advantages.

    s_i  = exp( mean_{t in y_i} (log pi_theta(y_it) - log pi_old(y_it)) )             sequence-level ratio
    L_i  = max( -A_i s_i , -A_i clip(s_i, 1 - eps_low, 1 + eps_high) )                 two-sided clip
    GSPO-token: s_it = sg[s_i] * pi_theta(y_it) / sg[pi_theta(y_it)]  (same value; per-token advantages allowed)

The token loss matrix is aggregated over the kept tokens (default: mean over tokens of each sequence, then mean
over sequences). verl's `compute_policy_loss_gspo` (core_algos.py, 0.9.1) was read for the GSPO-token form and its
conventions (log-ratio clamp max=10, no dual clip, clip fraction = tokens where the clipped branch is active);
tests/plugins/verl_k3 checks our values and gradients against it.
"""
from __future__ import annotations

from typing import Hashable, Literal, Sequence

import torch

from . import _checks
from .kl import KL_KINDS, KLKind, kl_per_token
from .off_policy import DEFAULT_BAND, _importance_weights, _mismatch_metrics, band_keep

AggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"]
AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
)


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: AggMode = "seq-mean-token-mean",
    *,
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    scale: float = 1.0,
    horizon: float | None = None,
) -> torch.Tensor:
    """Reduce a [B, T] loss matrix over the tokens of bool `mask` to a scalar.

    token-mean: sum / num_tokens; token-sum: sum; seq-mean-token-mean: mean over tokens per sequence, then sum /
    num_seqs; seq-mean-token-sum: token sum per sequence, then sum / num_seqs; seq-mean-token-sum-norm: that,
    divided by `horizon` (default T). `num_tokens` / `num_seqs` default to this batch's kept tokens / non-empty
    sequences (pass global counts under data parallelism); `scale` multiplies the result (e.g. the DP size).
    Sequences without kept tokens contribute nothing; an all-masked batch gives 0 (with a gradient graph).
    """
    if mode not in AGG_MODES:
        raise ValueError(f"agg mode must be one of {AGG_MODES}, got {mode!r}")
    lm = torch.where(mask, loss_mat, torch.zeros_like(loss_mat))
    if mode == "token-mean":
        denom = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
        return lm.sum() / denom * scale
    if mode == "token-sum":
        return lm.sum() * scale
    n_tok = mask.sum(-1)
    seq = lm.sum(-1)
    if mode == "seq-mean-token-mean":
        seq = seq / n_tok.clamp(min=1)
    denom = (n_tok > 0).sum().clamp(min=1) if num_seqs is None else num_seqs
    out = seq.sum() / denom * scale
    if mode == "seq-mean-token-sum-norm":
        out = out / (loss_mat.shape[-1] if horizon is None else horizon)
    return out


def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    *,
    token_level: bool = False,
    rollout_logp: torch.Tensor | None = None,
    is_band: tuple[float, float] | None = DEFAULT_BAND,
    is_level: Literal["token", "sequence"] | None = "token",
    policy_band: tuple[float, float] | None = None,
    seq_mask: bool = False,
    token_weights: torch.Tensor | None = None,
    seq_weights: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_kind: KLKind = "k3",
    agg: AggMode = "seq-mean-token-mean",
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    scale: float = 1.0,
    horizon: float | None = None,
    log_ratio_max: float = 10.0,
    allow_empty: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO loss (to minimise) and metrics.

    Tensors: `logp` [B, T] current policy (carries the gradient), `old_logp` [B, T] the trainer's log-probs of the
    sampling-time weights (pi_old), `advantages` [B] (or [B, T] with `token_level`), `response_mask` [B, T].
    Padding outside the mask may hold anything (even -inf); NaN/inf at response tokens raise ValueError.

    Off-policy corrections (all detached, none by default except when `rollout_logp` is given):
      * `rollout_logp` [B, T]: behaviour log-probs from the rollout engine. Tokens whose pi_old/mu ratio leaves
        `is_band` are masked out (they leave the denominators); kept tokens are weighted per `is_level`
        ("token": w_t, "sequence": geometric mean, None: 1). Mismatch metrics are reported under "mismatch/".
      * `policy_band`: also mask tokens whose pi_theta/pi_old ratio leaves this band.
      * `seq_mask`: with a band, reject whole sequences whose geometric-mean ratio leaves it.
      * `token_weights` [B, T]: extra per-token weights (e.g. verl's rollout_is_weights).
      * `seq_weights` [B] >= 0: per-sequence weights (staleness, `filter_stale`); 0 drops the sequence.
    `ref_logp` with `kl_coef` adds kl_coef * (estimator `kl_kind` of KL(pi_theta || ref), aggregated like the loss).
    `agg`, `num_tokens`, `num_seqs`, `scale`, `horizon`: see `aggregate`. `log_ratio_max` clamps the log ratio
    before exp (as verl). `allow_empty`: rows without response tokens are skipped instead of raising.

    Metrics (floats): loss, pg_loss, clip_frac, masked_frac, seq_masked_frac, ppo_kl, seq_ratio_{mean,min,max},
    num_tokens; kl_ref/kl_loss with `ref_logp`; mismatch/{k3_kl,max_abs_dlogp,mean_abs_dlogp}, is_weight_mean
    with `rollout_logp`.
    """
    lp = _checks.token_tensor("logp", logp)
    old = _checks.token_tensor("old_logp", old_logp, lp)
    mask = _checks.mask_tensor("response_mask", response_mask, lp)
    if not allow_empty:
        _checks.nonempty_rows("response_mask", mask)
    if not (0.0 <= eps_low < 1.0 and eps_high >= 0.0):
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got eps_low={eps_low}, eps_high={eps_high}")
    if agg not in AGG_MODES:
        raise ValueError(f"agg must be one of {AGG_MODES}, got {agg!r}")
    if kl_kind not in KL_KINDS:
        raise ValueError(f"kl_kind must be one of {KL_KINDS}, got {kl_kind!r}")
    _checks.finite_at("logp", lp, mask)
    _checks.finite_at("old_logp", old, mask)
    adv = _advantages(advantages, lp, mask, token_level)
    is_band = _checks.band("is_band", is_band)
    policy_band = _checks.band("policy_band", policy_band)

    zero = torch.zeros_like(lp)
    lp = torch.where(mask, lp, zero)
    old = torch.where(mask, old.detach(), zero)
    metrics: dict[str, float] = {}

    keep = mask
    weights = torch.ones_like(lp)
    if rollout_logp is not None:
        rl = _checks.token_tensor("rollout_logp", rollout_logp, lp)
        _checks.finite_at("rollout_logp", rl, mask)
        rl = torch.where(mask, rl.detach(), zero)
        if bool(mask.any()):
            metrics.update({f"mismatch/{k}": v for k, v in _mismatch_metrics(old, rl, mask, None).items()})
        iw = _importance_weights(old, rl, mask, is_band, is_level, seq_mask)
        keep, weights = iw.keep, iw.weights
        metrics["is_weight_mean"] = iw.metrics["is_weight_mean"]
    if policy_band is not None:
        keep = band_keep(lp.detach() - old, keep, policy_band, seq_mask)
    n_resp = int(mask.sum())
    had = mask.any(-1)
    metrics["masked_frac"] = (n_resp - int(keep.sum())) / max(n_resp, 1)
    metrics["seq_masked_frac"] = float((had & ~keep.any(-1)).sum()) / max(int(had.sum()), 1)
    if token_weights is not None:
        tw = _checks.token_tensor("token_weights", token_weights, lp)
        _checks.finite_at("token_weights", tw, mask)
        if bool(((tw < 0) & mask).any()):
            raise ValueError("token_weights must be >= 0 at response tokens")
        weights = weights * torch.where(mask, tw.detach(), zero)
    if seq_weights is not None:
        sw = _seq_weights(seq_weights, lp)
        keep = keep & (sw > 0)[:, None]
        weights = weights * sw[:, None]

    # Sequence-level log ratio over the kept tokens: masked tokens give no gradient, even through s_i.
    n_keep = keep.sum(-1)
    log_ratio = torch.where(keep, lp - old, zero)
    log_s = log_ratio.sum(-1) / n_keep.clamp(min=1)
    if token_level:
        ratio = torch.exp((lp - lp.detach() + log_s.detach()[:, None]).clamp(max=log_ratio_max))
        a = adv if adv.dim() == 2 else adv[:, None]
    else:
        ratio = torch.exp(log_s.clamp(max=log_ratio_max))[:, None]
        a = adv[:, None]
    pg1 = -a * ratio
    pg2 = -a * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    pg_mat = torch.maximum(pg1, pg2).expand_as(lp) * weights
    clipped = (pg2 > pg1).expand_as(lp)
    agg_kw = dict(num_tokens=num_tokens, num_seqs=num_seqs, scale=scale, horizon=horizon)
    pg_loss = aggregate(pg_mat, keep, agg, **agg_kw)
    loss = pg_loss

    if ref_logp is not None:
        ref = _checks.token_tensor("ref_logp", ref_logp, lp)
        _checks.finite_at("ref_logp", ref, mask)
        kl_mat = kl_per_token(lp, torch.where(mask, ref.detach(), zero), kl_kind)
        kl_loss = aggregate(kl_mat, keep, agg, **agg_kw)
        metrics["kl_ref"] = float(kl_mat.detach().masked_fill(~keep, 0.0).sum()) / max(int(keep.sum()), 1)
        metrics["kl_loss"] = float(kl_loss.detach())
        if kl_coef != 0.0:
            loss = loss + kl_coef * kl_loss
    elif kl_coef != 0.0:
        raise ValueError("kl_coef is set but ref_logp is None")

    n_k = max(int(keep.sum()), 1)
    valid = n_keep > 0
    s_valid = torch.exp(log_s.detach()[valid])
    metrics.update(
        loss=float(loss.detach()),
        pg_loss=float(pg_loss.detach()),
        clip_frac=float((clipped & keep).sum()) / n_k,
        ppo_kl=float((old - lp.detach()).masked_fill(~keep, 0.0).sum()) / n_k,
        seq_ratio_mean=float(s_valid.mean()) if s_valid.numel() else 1.0,
        seq_ratio_min=float(s_valid.min()) if s_valid.numel() else 1.0,
        seq_ratio_max=float(s_valid.max()) if s_valid.numel() else 1.0,
        num_tokens=float(keep.sum()),
    )
    return loss, metrics


def _advantages(advantages: object, lp: torch.Tensor, mask: torch.Tensor, token_level: bool) -> torch.Tensor:
    """Validate advantages: [B], or [B, T] when `token_level`; finite where used; returned detached fp32/fp64."""
    if not isinstance(advantages, torch.Tensor):
        raise ValueError(f"advantages must be a torch.Tensor, got {type(advantages).__name__}")
    b = lp.shape[0]
    if advantages.device != lp.device:
        raise ValueError(f"advantages is on {advantages.device} but logp is on {lp.device}")
    if advantages.dim() == 1:
        if advantages.shape[0] != b:
            raise ValueError(f"advantages shape {tuple(advantages.shape)} does not match batch size {b} of logp")
        if not bool(torch.isfinite(advantages).all()):
            raise ValueError("advantages has NaN/inf values")
    elif advantages.dim() == 2:
        if not token_level:
            raise ValueError("advantages is [B, T]: per-token advantages need token_level=True (GSPO-token)")
        if advantages.shape != lp.shape:
            raise ValueError(
                f"advantages shape {tuple(advantages.shape)} does not match logp shape {tuple(lp.shape)}"
            )
        _checks.finite_at("advantages", advantages, mask)
        advantages = torch.where(mask, advantages, torch.zeros_like(advantages))
    else:
        raise ValueError(f"advantages must be [B] (or [B, T]), got shape {tuple(advantages.shape)}")
    return advantages.detach().to(lp.dtype)


def _seq_weights(seq_weights: object, lp: torch.Tensor) -> torch.Tensor:
    """Validate per-sequence weights [B] >= 0."""
    if not isinstance(seq_weights, torch.Tensor):
        seq_weights = torch.as_tensor(seq_weights, device=lp.device)
    if seq_weights.shape != (lp.shape[0],):
        raise ValueError(f"seq_weights shape {tuple(seq_weights.shape)} does not match batch size {lp.shape[0]}")
    sw = seq_weights.detach().to(device=lp.device, dtype=lp.dtype)
    if not bool(torch.isfinite(sw).all()) or bool((sw < 0).any()):
        raise ValueError("seq_weights must be finite and >= 0")
    return sw


def group_advantages(
    rewards: torch.Tensor | Sequence[float],
    group_ids: torch.Tensor | Sequence[Hashable] | None = None,
    group_size: int | None = None,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-normalised advantages A_i = (r_i - mean_g r) / (std_g r + eps) within each prompt group g.

    Groups come from `group_ids` (any hashable per response, e.g. prompt uids) or `group_size` (consecutive
    blocks of G responses). std is the sample std (Bessel), as GRPO/verl; a group of one, or of equal rewards,
    gets advantage 0. `scale_by_std=False` only centres (Dr. GRPO style). Returns float32 [N] (fp64 if given).
    """
    r = torch.as_tensor(rewards)
    if r.dim() != 1 or r.numel() == 0:
        raise ValueError(f"rewards must be a non-empty 1-D tensor, got shape {tuple(r.shape)}")
    if r.dtype == torch.bool or not (r.is_floating_point() or r.dtype in (torch.int32, torch.int64)):
        raise ValueError(f"rewards must be numeric, got dtype {r.dtype}")
    out_dtype = torch.float64 if r.dtype == torch.float64 else torch.float32
    r = r.double()
    if not bool(torch.isfinite(r).all()):
        bad = (~torch.isfinite(r)).nonzero().flatten().tolist()
        raise ValueError(f"rewards has NaN/inf values at indices {bad[:8]}")
    n = r.shape[0]
    if (group_ids is None) == (group_size is None):
        raise ValueError("give exactly one of group_ids or group_size")
    if group_size is not None:
        if group_size < 1 or n % group_size != 0:
            raise ValueError(f"group_size {group_size} does not divide the number of rewards {n}")
        gid = torch.arange(n, device=r.device) // group_size
    else:
        ids = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
        if len(ids) != n:
            raise ValueError(f"group_ids has {len(ids)} entries but rewards has {n}")
        index: dict[Hashable, int] = {}
        gid = torch.tensor([index.setdefault(g, len(index)) for g in ids], device=r.device)
    g = int(gid.max()) + 1
    count = torch.zeros(g, dtype=torch.float64, device=r.device).index_add_(0, gid, torch.ones_like(r))
    mean = torch.zeros_like(count).index_add_(0, gid, r) / count
    centred = r - mean[gid]
    if scale_by_std:
        ss = torch.zeros_like(count).index_add_(0, gid, centred.square())
        std = (ss / (count - 1).clamp(min=1)).sqrt()
        centred = centred / (std[gid] + eps)
    return centred.to(out_dtype)
