"""RL batches for TorchTitan's loop: a rollout batch file (safetensors) read by `RLBatchDataLoader`, each batch
carrying what GSPO needs beside the tokens, so `K3GSPOTrainer` (rl_trainer.py) runs GSPO steps through the stock
train loop.

File tensors (N rollouts of seq_len + 1 tokens; `write_rl_batch` checks them and writes the file):
  tokens [N, seq_len + 1] long     prompt + response (+ padding), the model reads tokens[:, :-1]
  response_mask [N, seq_len] bool  which labels (tokens[:, 1:]) are response tokens: the others are IGNORE_INDEX
  old_logp [N, seq_len] float      pi_old log-probs of the labels (the trainer's, at sampling-time weights)
  advantages [N] float             one per rollout (GSPO is sequence level)
  routed_experts [N, seq_len, n_moe, k] long, optional: the rollout's routing (Router Replay; -1 rows route freely)

Batch i of data-parallel rank d holds rows (i * dp_world + d) * B ... + B - 1 in file order (the whole file's rows
once, then again), so 1 rank with batch 2B sees what 2 ranks with batch B see together."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.tokenizer import BaseTokenizer

#: input_dict keys the RL trainer takes out of the model's keyword arguments (routed_experts stays: the model's)
RL_KEYS = ("old_logp", "advantages")


def check_rl_batch(tensors: dict[str, torch.Tensor], source: str) -> int:
    """Validate an RL batch's tensors (names, dtypes, shapes, finiteness); returns seq_len. Errors name the tensor."""
    required = ("tokens", "response_mask", "old_logp", "advantages")
    missing = [k for k in required if k not in tensors]
    unknown = sorted(set(tensors) - set(required) - {"routed_experts"})
    if missing or unknown:
        raise ValueError(f"{source}: missing tensors {missing}, unknown tensors {unknown}")
    tokens, mask, old, adv = (tensors[k] for k in required)
    if tokens.dim() != 2 or tokens.dtype != torch.long or tokens.shape[1] < 2:
        raise ValueError(f"{source}: tokens must be long [N, seq_len + 1], got {tokens.dtype} {tuple(tokens.shape)}")
    n, seq_len = tokens.shape[0], tokens.shape[1] - 1
    if mask.dtype != torch.bool or tuple(mask.shape) != (n, seq_len):
        raise ValueError(f"{source}: response_mask must be bool [{n}, {seq_len}], got {mask.dtype} "
                         f"{tuple(mask.shape)}")
    if not bool(mask.any(-1).all()):
        raise ValueError(f"{source}: response_mask: rows {mask.any(-1).logical_not().nonzero()[:, 0].tolist()} have "
                         "no response token")
    if not old.is_floating_point() or tuple(old.shape) != (n, seq_len) or not bool(old[mask].isfinite().all()):
        raise ValueError(f"{source}: old_logp must be finite float [{n}, {seq_len}] at response tokens, got "
                         f"{old.dtype} {tuple(old.shape)}")
    if not adv.is_floating_point() or tuple(adv.shape) != (n,) or not bool(adv.isfinite().all()):
        raise ValueError(f"{source}: advantages must be finite float [{n}], got {adv.dtype} {tuple(adv.shape)}")
    routed = tensors.get("routed_experts")
    if routed is not None and (routed.dtype != torch.long or routed.dim() != 4 or tuple(routed.shape[:2]) != (n, seq_len)):
        raise ValueError(f"{source}: routed_experts must be long [{n}, {seq_len}, n_moe, k], got {routed.dtype} "
                         f"{tuple(routed.shape)}")
    return seq_len


def write_rl_batch(path: str | Path, **tensors: torch.Tensor) -> Path:
    """Write an RL batch file (the tensors named in the module docstring), checked first."""
    path = Path(path)
    check_rl_batch(tensors, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


class _Rollouts(IterableDataset):
    def __init__(self, tensors: dict[str, torch.Tensor], batch: int, dp_rank: int, dp_world_size: int) -> None:
        self.tensors, self.batch = tensors, batch
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.n = tensors["tokens"].shape[0]
        self.next_batch = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            first = (self.next_batch * self.dp_world_size + self.dp_rank) * self.batch
            self.next_batch += 1
            for row in range(first, first + self.batch):
                yield {k: v[row % self.n] for k, v in self.tensors.items()}

    def state_dict(self) -> dict[str, int]:
        return {"next_batch": self.next_batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next_batch = int(state["next_batch"])


class RLBatchDataLoader(ParallelAwareDataloader):
    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        path: str = ""
        """The RL batch file (safetensors, tensors as in k3_torchtitan.rl_data)."""
        router_replay: bool = True
        """Replay the file's routed_experts (R3); False routes every token with the live router."""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: BaseTokenizer | None,
                 seq_len: int, local_batch_size: int, snapshot_every_n_steps: int | None = None) -> None:
        if not config.path:
            raise ValueError("dataloader.path: an RL batch file is required (k3_torchtitan.rl_data.write_rl_batch)")
        if not Path(config.path).is_file():
            raise ValueError(f"dataloader.path: {config.path!r} is not a file")
        tensors = load_file(config.path)
        file_seq = check_rl_batch(tensors, f"dataloader.path {config.path}")
        if file_seq != seq_len:
            raise ValueError(f"training.seq_len: {seq_len}, but the RL batch file {config.path} holds "
                             f"{file_seq}-token rollouts")
        if not config.router_replay:
            tensors.pop("routed_experts", None)
        self.config = config
        super().__init__(_Rollouts(tensors, local_batch_size, dp_rank, dp_world_size), dp_rank=dp_rank,
                         dp_world_size=dp_world_size, batch_size=local_batch_size, collate_fn=self._collate)

    @staticmethod
    def _collate(rows: list[dict[str, torch.Tensor]]):
        batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        tokens = batch.pop("tokens")
        inputs = tokens[:, :-1].contiguous()
        labels = tokens[:, 1:].masked_fill(~batch.pop("response_mask"), IGNORE_INDEX).contiguous()
        T = inputs.shape[1]
        out = {"input": inputs, "positions": torch.arange(T).expand(inputs.shape[0], T).contiguous(), **batch}
        return out, labels


def label_logp(model, tokens: torch.Tensor, routed_experts: torch.Tensor | None = None) -> torch.Tensor:
    """log pi(tokens[:, 1:]) [N, seq_len] under a k3.model `K3ForCausalLM` (fp32, no gradient)."""
    with torch.no_grad():
        logits = model(tokens[:, :-1], use_cache=False, routed_experts=routed_experts).logits
    return torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]


def example_rl_batch(model, rows: int, seq_len: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A small RL batch for the CPU tests and the parity benchmark (write it with `write_rl_batch`): arithmetic-corpus
    tokens; row i's response starts at label 10 + 2 (i % 4); pi_old log-probs are `model`'s plus N(0, 0.05) noise
    (off-policy enough for non-trivial ratios, inside PPO-width clip bands); advantages cycle 1, -0.7, 0.4, -1.2;
    a recorded routing (data.recorded_routing) for every token except row 0's first 6 (they route freely)."""
    from .data import ByteTokenizer, arithmetic_corpus, recorded_routing

    cfg = model.config
    ids = torch.tensor(ByteTokenizer().encode(arithmetic_corpus(16 * rows, seed=seed + 1))[:rows * (seq_len + 1)])
    if ids.numel() < rows * (seq_len + 1):
        raise ValueError(f"rows / seq_len: the corpus is too short for {rows} rows of {seq_len + 1} tokens")
    ids = ids.view(rows, seq_len + 1)
    starts = 10 + 2 * (torch.arange(rows) % 4)
    mask = torch.arange(seq_len)[None, :] >= starts[:, None]
    g = torch.Generator().manual_seed(seed)
    old = label_logp(model, ids) + 0.05 * torch.randn(rows, seq_len, generator=g)
    routed = recorded_routing(ids[:, :-1], len(cfg.moe_layer_ids), cfg.num_experts_per_token, cfg.num_experts)
    routed[0, :6] = -1
    advantages = torch.tensor([1.0, -0.7, 0.4, -1.2]).repeat((rows + 3) // 4)[:rows]
    return dict(tokens=ids, response_mask=mask, old_logp=old, advantages=advantages, routed_experts=routed)
