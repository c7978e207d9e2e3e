"""A local tokenizer and dataset for TorchTitan runs without downloads (CPU CI, smoke runs).

`ByteTokenizer`: UTF-8 bytes shifted past K3's special ids (pad 0, bos 1, eos 2), so any K3 vocabulary >= 259
holds it. `ArithmeticDataLoader`: a deterministic, learnable corpus ("37+5=42\n" lines from a seeded generator)
packed into [B, seq_len + 1] windows, sharded over data-parallel ranks, resumable (its position is checkpointed
through TorchTitan's StatefulDataLoader). With `routing_layers > 0` each batch also carries `routed_experts`
[B, seq_len, routing_layers, routing_top_k]: a recorded routing for Router Replay (a fixed function of the token
and its position: distinct experts per token and layer)."""
from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import BaseTokenizer

BYTE_OFFSET = 3


class ByteTokenizer(BaseTokenizer):
    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config | None = None, tokenizer_path: str | None = None) -> None:
        super().__init__()
        self.bos_id, self.eos_id, self.pad_id = 1, 2, 0

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False, **_) -> list[int]:
        ids = [b + BYTE_OFFSET for b in text.encode("utf-8")]
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids: list[int], **_) -> str:
        return bytes(i - BYTE_OFFSET for i in ids if i >= BYTE_OFFSET).decode("utf-8", errors="replace")

    def get_vocab_size(self) -> int:
        return 256 + BYTE_OFFSET


def arithmetic_corpus(lines: int, seed: int) -> str:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        a, b = rng.randrange(100), rng.randrange(100)
        out.append(f"{a}+{b}={a + b}\n")
    return "".join(out)


def recorded_routing(tokens: torch.Tensor, layers: int, top_k: int, experts: int) -> torch.Tensor:
    """A deterministic routing [B, T, layers, top_k] of distinct experts per (token, layer)."""
    B, T = tokens.shape
    pos = torch.arange(T).view(1, T, 1, 1)
    layer = torch.arange(layers).view(1, 1, layers, 1)
    slot = torch.arange(top_k).view(1, 1, 1, top_k)
    base = (tokens.view(B, T, 1, 1) * 7 + pos * 3 + layer * 5) % experts
    return ((base + slot) % experts).long()


class _PackedWindows(IterableDataset):
    """Windows of seq_len + 1 tokens over the tokenized corpus; window i goes to rank i % dp_world_size."""

    def __init__(self, tokens: list[int], seq_len: int, dp_rank: int, dp_world_size: int) -> None:
        self.tokens = torch.tensor(tokens, dtype=torch.long)
        self.seq_len, self.dp_rank, self.dp_world_size = seq_len, dp_rank, dp_world_size
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < dp_world_size:
            raise ValueError(f"dataloader.corpus_lines: the corpus holds {self.n_windows} windows of "
                             f"seq_len {seq_len}, fewer than the {dp_world_size} data-parallel ranks")
        self.next_window = dp_rank

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            i = self.next_window % self.n_windows
            self.next_window += self.dp_world_size
            yield self.tokens[i * self.seq_len:i * self.seq_len + self.seq_len + 1]

    def state_dict(self) -> dict[str, int]:
        return {"next_window": self.next_window}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next_window = int(state["next_window"])


class ArithmeticDataLoader(ParallelAwareDataloader):
    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        corpus_lines: int = 2048
        seed: int = 0
        routing_layers: int = 0
        """> 0: batches carry `routed_experts` for this many MoE layers (Router Replay)."""
        routing_top_k: int = 0
        routing_experts: int = 0

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: BaseTokenizer,
                 seq_len: int, local_batch_size: int, snapshot_every_n_steps: int | None = None) -> None:
        if config.routing_layers and (config.routing_top_k < 1 or config.routing_experts < config.routing_top_k):
            raise ValueError(f"dataloader.routing_top_k / routing_experts: need 1 <= top_k <= experts, got "
                             f"{config.routing_top_k} / {config.routing_experts}")
        self.config = config
        tokens = tokenizer.encode(arithmetic_corpus(config.corpus_lines, config.seed))
        dataset = _PackedWindows(tokens, seq_len, dp_rank, dp_world_size)
        super().__init__(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=local_batch_size,
                         collate_fn=self._collate)

    def _collate(self, windows: list[torch.Tensor]):
        batch = torch.stack(windows)
        inputs, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        T = inputs.shape[1]
        out = {"input": inputs, "positions": torch.arange(T).expand(inputs.shape[0], T).contiguous()}
        c = self.config
        if c.routing_layers:
            out["routed_experts"] = recorded_routing(inputs, c.routing_layers, c.routing_top_k, c.routing_experts)
        return out, labels
