"""GSPO inside TorchTitan's own training loop: `K3GSPOTrainer` is a `Trainer` subclass, selected the way TorchTitan
selects any component, by the config object the `--config` function returns (`K3GSPOTrainer.Config(...).build()`
builds it; config_registry.k3_tiny_gspo_cpu). Everything else is the stock loop: batching, gradient accumulation,
the global token count, FSDP / EP / CP, clipping, the optimizer, checkpoints, logging.

What it adds is the one thing the stock loop lacks, the RL fields of a batch reaching the loss: its
`post_dataloading_process` takes `old_logp` and `advantages` (RLBatchDataLoader, rl_data.py) out of the model's
keyword arguments, derives the response mask from the labels (non-response labels are IGNORE_INDEX, so
TorchTitan's global valid-token count is the response-token count GSPO's token-mean divides by) and hands them to
`GSPOLoss.set_batch` before the stock forward/backward. `routed_experts` stays a model keyword (Router Replay).
Under CP the RL fields stay whole (the loss gathers the sequence's log-probs: loss.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.trainer import Trainer

from .loss import GSPOLoss, RLBatch
from .rl_data import RL_KEYS, RLBatchDataLoader


class K3GSPOTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        def __post_init__(self):
            Trainer.Config.__post_init__(self)
            if not isinstance(self.loss, GSPOLoss.Config):
                raise ValueError(f"loss: K3GSPOTrainer needs GSPOLoss.Config, got {type(self.loss).__name__}")
            if not isinstance(self.dataloader, RLBatchDataLoader.Config):
                raise ValueError("dataloader: K3GSPOTrainer needs RLBatchDataLoader.Config, got "
                                 f"{type(self.dataloader).__name__}")

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        if self.parallel_dims.pp_enabled:
            raise ValueError("parallelism.pipeline_parallel_degree: K3GSPOTrainer runs without pipeline parallelism")
        if self.parallel_dims.cp_enabled:
            self.loss_fn.cp_group = self.parallel_dims.get_mesh("cp").get_group()

    def post_dataloading_process(self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor
                                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        missing = [k for k in RL_KEYS if k not in input_dict]
        if missing:
            raise ValueError(f"batch: RL fields {missing} missing (the dataloader must be RLBatchDataLoader)")
        rl = {k: input_dict.pop(k) for k in RL_KEYS}
        self.loss_fn.set_batch(RLBatch(old_logp=rl["old_logp"], advantages=rl["advantages"],
                                       response_mask=labels != IGNORE_INDEX))
        return super().post_dataloading_process(input_dict, labels)
