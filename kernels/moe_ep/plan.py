"""The expert-parallel pipeline's configuration and schedule (plain Python: no torch.distributed, no Triton).

Tokens of each rank are split into `micro_batches` equal-as-possible contiguous chunks (the same count on every
rank). Step s of the forward runs the dispatch of micro-batch s, the local experts of micro-batch s - 1 and the
combine of micro-batch s - 2 (on CUDA on three streams ordered by events; on gloo one after the other, in the
same order and with the same math). The backward runs the same three-stage schedule over the gradients. Dispatch
staging lives in a ring buffer of `ring_slots` slots: micro-batch i is staged in slot i % ring_slots, so the
staging memory is bounded by the slot count, not the micro-batch count."""
from __future__ import annotations

import enum
from dataclasses import dataclass

# the pipeline has three stages in flight: a slot is refilled only after the micro-batch two steps earlier left it
MIN_RING_SLOTS = 2


class Compute(enum.Enum):
    """What runs the sort, staging, local experts and combine (the exchanges are the group's either way)."""
    SPEC = "spec"          # plain torch (k3_kernels.moe.naive): bitwise the spec on CPU
    KERNELS = "kernels"    # the moe Triton kernels (on CPU under TRITON_INTERPRET=1: the GPU path's math)


@dataclass(frozen=True)
class EPConfig:
    """micro_batches: chunks of each rank's tokens pipelined through dispatch / experts / combine (>= 1).
    ring_slots: dispatch staging slots (>= 2: micro-batch i + 1 is received while i is in the experts).
    fp8: dispatch e4m3 rows with 1 x 128 fp32 scales, quantised while staging (forward only: no autograd).
    check_across_ranks: before any exchange, all-gather every rank's shapes / dtypes / verdict so that bad input
        raises the same error on every rank (one small all-gather per call; trusted hot loops may turn it off).
    compute: Compute, or None: the kernels on CUDA tensors, the spec elsewhere."""

    micro_batches: int = 2
    ring_slots: int = 2
    fp8: bool = False
    check_across_ranks: bool = True
    compute: Compute | None = None

    def __post_init__(self):
        if not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise ValueError(f"EPConfig.micro_batches must be an int >= 1, got {self.micro_batches!r}")
        if not isinstance(self.ring_slots, int) or self.ring_slots < MIN_RING_SLOTS:
            raise ValueError(f"EPConfig.ring_slots must be an int >= {MIN_RING_SLOTS}, got {self.ring_slots!r}")
        if not isinstance(self.fp8, bool):
            raise TypeError(f"EPConfig.fp8 must be a bool, got {self.fp8!r}")
        if self.compute is not None and not isinstance(self.compute, Compute):
            raise TypeError(f"EPConfig.compute must be a Compute or None, got {self.compute!r}")

    def kernels(self, on_cuda: bool) -> bool:
        return self.compute is Compute.KERNELS or (self.compute is None and on_cuda)


@dataclass(frozen=True)
class Step:
    """What one pipeline step runs: micro-batch ids (None: that stage idles in this step)."""
    dispatch: int | None
    experts: int | None
    combine: int | None


def schedule(micro_batches: int) -> list[Step]:
    """micro_batches + 2 steps; stage order within a step: dispatch, experts, combine."""
    def live(i: int) -> int | None:
        return i if 0 <= i < micro_batches else None

    return [Step(live(s), live(s - 1), live(s - 2)) for s in range(micro_batches + 2)]


def micro_batch_bounds(n_tokens: int, micro_batches: int) -> list[tuple[int, int]]:
    """[start, end) of each micro-batch's tokens (the first n % m chunks one token longer; some may be empty)."""
    base, extra = divmod(n_tokens, micro_batches)
    out, start = [], 0
    for i in range(micro_batches):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def slot_of(micro_batch: int, config: EPConfig) -> int:
    return micro_batch % config.ring_slots
