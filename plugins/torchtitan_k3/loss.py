"""GSPO (k3.rl.gspo_loss) as a TorchTitan loss: `GSPOLoss.Config` goes where `Trainer.Config.loss` is, and the
loss is called as TorchTitan calls losses, `loss_fn(pred, labels, global_valid_tokens)`, with the RL fields of the
batch (pi_old log-probs, advantages, response mask, optional rollout log-probs) set beforehand with `set_batch`
(TorchTitan's trainer hands a loss only logits and labels). Log-probs are taken from the logits of the labels in
fp32; with "token-mean" aggregation the denominator is TorchTitan's global valid-token count, so summed gradients
over data-parallel ranks equal the single-rank loss's.

Under context parallelism (`cp_group` set by the RL trainer) each rank holds a contiguous slice of every sequence,
but GSPO's ratio is a mean over the whole sequence: the label log-probs are all-gathered along the sequence (with
autograd: the backward reduce-scatters), every rank evaluates the same full-sequence loss on the full RL batch and
returns 1/CP of it, so the CP ranks' losses sum (TorchTitan's logged loss) and their gradients sum to the
unsharded loss's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.loss import BaseLoss

from k3.rl import gspo_loss

from .comm import gather_along


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
        self.cp_group = None
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
        share = 1.0
        if self.cp_group is not None:
            import torch.distributed as dist

            logp = torch.cat(gather_along(logp, 1, self.cp_group), dim=1)
            share = 1.0 / dist.get_world_size(self.cp_group)
        c = self.config
        num_tokens = global_valid_tokens if c.agg == "token-mean" else None
        loss, metrics = gspo_loss(logp, b.old_logp, b.advantages, b.response_mask, c.eps_low, c.eps_high,
                                  token_level=c.token_level, rollout_logp=b.rollout_logp, agg=c.agg,
                                  num_tokens=num_tokens)
        return loss * share if share != 1.0 else loss, {k: torch.tensor(float(v)) for k, v in metrics.items()}
