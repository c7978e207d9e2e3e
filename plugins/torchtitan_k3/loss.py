"""GSPO (k3.rl.gspo_loss) as a TorchTitan loss: `GSPOLoss.Config` goes where `Trainer.Config.loss` is, and the
loss is called as TorchTitan calls losses, `loss_fn(pred, labels, global_valid_tokens)`, with the RL fields of the
batch (pi_old log-probs, advantages, response mask, optional rollout log-probs) set beforehand with `set_batch`
(TorchTitan's trainer hands a loss only logits and labels). Log-probs are taken from the logits of the labels in
fp32; with "token-mean" aggregation the denominator is TorchTitan's global valid-token count, so summed gradients
over data-parallel ranks equal the single-rank loss's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.loss import BaseLoss

from k3.rl import gspo_loss


@dataclass(frozen=True)
class RLBatch:
    old_logp: torch.Tensor                    # [B, T] pi_old log-probs of the labels
    advantages: torch.Tensor                  # [B] (or [B, T] with token_level)
    response_mask: torch.Tensor               # [B, T] bool
    rollout_logp: torch.Tensor | None = None  # [B, T] behaviour log-probs (off-policy correction)


class GSPOLoss(BaseLoss):
    @dataclass(kw_only=True, slots=True)
    class Config(BaseLoss.Config):
        eps_low: float = 3e-4
        eps_high: float = 4e-4
        token_level: bool = False
        agg: str = "token-mean"

    def __init__(self, config: Config, *, compile_config=None) -> None:
        self.config = config
        self.batch: RLBatch | None = None
        self.fn = self._unused

    @staticmethod
    def _unused(pred, labels):
        raise RuntimeError("GSPOLoss is called through __call__ with an RL batch set")

    def set_batch(self, batch: RLBatch) -> None:
        if not isinstance(batch, RLBatch):
            raise TypeError(f"batch: expected an RLBatch, got {type(batch).__name__}")
        self.batch = batch

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor, global_valid_tokens: torch.Tensor | None = None,
                 **kwargs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        b = self.batch
        if b is None:
            raise ValueError("GSPOLoss: no RL batch set (call set_batch(RLBatch(...)) before the forward)")
        if pred.shape[:2] != labels.shape:
            raise ValueError(f"labels: shape {tuple(labels.shape)} does not match logits {tuple(pred.shape)}")
        logp = torch.log_softmax(pred.float(), dim=-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        c = self.config
        num_tokens = global_valid_tokens if c.agg == "token-mean" else None
        loss, metrics = gspo_loss(logp, b.old_logp, b.advantages, b.response_mask, c.eps_low, c.eps_high,
                                  token_level=c.token_level, rollout_logp=b.rollout_logp, agg=c.agg,
                                  num_tokens=num_tokens)
        return loss, {k: torch.tensor(float(v)) for k, v in metrics.items()}
