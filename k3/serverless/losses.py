"""The service's losses over one session's rows, Tinker's definitions (summed over tokens, weighted by `weights`):

    cross_entropy        -sum_t w_t log p(y_t)
    importance_sampling  -sum_t w_t r_t A_t,                       r_t = exp(log p(y_t) - logprobs_t)
    ppo                  -sum_t w_t min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t)
    gspo                 k3.rl.gspo_loss (GSPO-token, sequence ratio over the tokens with w_t > 0, two-sided clip
                         eps_low / eps_high; pi_old = the sampler's `logprobs`), aggregated as a token sum
    cispo                -sum_t w_t sg(clip(r_t, 1 - cispo_clip_low, 1 + cispo_clip_high)) A_t log p(y_t)
                         (CISPO, MiniMax-M1, arXiv 2506.13585: the importance weight is clipped and detached, every
                         token keeps its gradient; by default no lower bound)
    logprob_linear       sum_t w_t g_t log p(y_t), g = `logprob_grads`: the gradient of any loss of the log-probs
                         taken at a forward's log-probs (forward_backward_custom sends it); its parameter gradient
                         is that loss's

Every input is [n, T] (the session's rows, padded to the batch's bucket length; padding has w = 0). The loss of a
row depends only on that row: a session's loss is the same whatever other sessions share the forward."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from k3.rl import gspo_loss
from k3.serverless.types import LOSS_FNS


@dataclass(frozen=True)
class LossConfig:
    """`loss_fn_config` of forward_backward; only the fields of the chosen loss are read."""
    clip_low: float = 0.2        # ppo
    clip_high: float = 0.2       # ppo
    eps_low: float = 3e-4        # gspo (paper values)
    eps_high: float = 4e-4       # gspo
    cispo_clip_low: float = 1.0  # cispo: 1 = no lower bound (weights >= 0)
    cispo_clip_high: float = 0.28  # cispo: the upper truncation (a setting to tune; MiniMax-M1 tunes only this one)

    @classmethod
    def from_json(cls, d: dict | None, where: str = "loss_fn_config") -> "LossConfig":
        d = d or {}
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected an object")
        known = {"clip_low", "clip_high", "eps_low", "eps_high", "cispo_clip_low", "cispo_clip_high"}
        for k, v in d.items():
            if k not in known:
                raise ValueError(f"{where}.{k}: unknown option (known: {sorted(known)})")
            hi, closed = {"cispo_clip_low": (1.0, True), "cispo_clip_high": (100.0, True)}.get(k, (1.0, False))
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 <= v <= hi if closed else 0 <= v < hi):
                raise ValueError(f"{where}.{k}: must be a number in [0, {hi:g}{']' if closed else ')'}, got {v!r}")
        return cls(**{k: float(v) for k, v in d.items()})


def session_loss(loss_fn: str, lp: torch.Tensor, inputs: dict[str, torch.Tensor], cfg: LossConfig
                 ) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss (scalar, carries the gradient) of one session's rows and its metrics. `lp` [n, T] the trainer's
    log-probs of the target tokens; `inputs` [n, T] tensors: weights (0 at padding) and the loss's own inputs."""
    if loss_fn not in LOSS_FNS:
        raise ValueError(f"loss_fn: unknown {loss_fn!r} (choose from {list(LOSS_FNS)})")
    w = inputs["weights"]
    keep = w > 0
    zero = torch.zeros_like(lp)
    lp_k = torch.where(keep, lp, zero)
    if loss_fn == "cross_entropy":
        loss = -(w * lp_k).sum()
        return loss, {"loss": float(loss.detach()), "num_tokens": float(keep.sum())}
    if loss_fn == "logprob_linear":
        loss = (w * torch.where(keep, inputs["logprob_grads"], zero) * lp_k).sum()
        return loss, {"loss": float(loss.detach()), "num_tokens": float(keep.sum())}
    old = torch.where(keep, inputs["logprobs"], zero)
    adv = torch.where(keep, inputs["advantages"], zero)
    if loss_fn == "gspo":
        loss, m = gspo_loss(lp_k, old, adv, keep, cfg.eps_low, cfg.eps_high, token_level=True, is_band=None,
                            is_level=None, agg="token-sum", allow_empty=True)
        return loss, {k: m[k] for k in ("loss", "clip_frac", "num_tokens")}
    ratio = torch.exp(lp_k - old)
    if loss_fn == "cispo":
        r = ratio.detach()
        weight = r.clamp(1.0 - cfg.cispo_clip_low, 1.0 + cfg.cispo_clip_high)
        loss = -(w * weight * adv * lp_k).sum()
        clip_frac = float(((weight != r) & keep).sum()) / max(float(keep.sum()), 1.0)
        return loss, {"loss": float(loss.detach()), "clip_frac": clip_frac, "num_tokens": float(keep.sum())}
    if loss_fn == "importance_sampling":
        loss = -(w * ratio * adv).sum()
        return loss, {"loss": float(loss.detach()), "num_tokens": float(keep.sum())}
    clipped = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    obj = torch.minimum(ratio * adv, clipped * adv)
    loss = -(w * obj).sum()
    clip_frac = float(((ratio * adv != obj) & keep).sum()) / max(float(keep.sum()), 1.0)
    return loss, {"loss": float(loss.detach()), "clip_frac": clip_frac, "num_tokens": float(keep.sum())}
