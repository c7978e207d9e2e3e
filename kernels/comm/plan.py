"""Which all-reduce algorithm runs, and the index math both share (plain Python: no torch.distributed, no Triton).

* one-shot: every rank reads all W peers' whole buffers and sums them in rank order. One synchronisation, W x the
  message read per rank: the low-latency choice for small messages.
* two-shot: rank r sums shard r of every peer in rank order (reduce-scatter), then every rank gathers all shards
  (all-gather). Two synchronisations, 2 x the message moved per rank: the bandwidth choice for large messages.

Both sum element i in rank order 0..W-1 in fp32 and round once, so they return the same bits (naive.py)."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Algorithm(enum.Enum):
    ONE_SHOT = "one_shot"
    TWO_SHOT = "two_shot"


class Sync(enum.Enum):
    """How the symmetric-memory kernels wait for their peers (peer_sum.py, symm_mem.py)."""
    IN_KERNEL = "in_kernel"        # one launch per call; programs meet their peers' programs through signal pads
    HOST_BARRIER = "host_barrier"  # one launch per stage, torch's `_SymmetricMemory.barrier` between them


@dataclass(frozen=True)
class AllReduceConfig:
    """Thresholds for the algorithm choice and the checks.

    one_shot_max_bytes: messages up to this size use one-shot (on worlds of at most one_shot_max_world ranks);
        larger ones, or larger worlds (one-shot's reads grow with W), use two-shot. The defaults are a first
        setting to be replaced by `benchmarks/allreduce.py`'s crossover on 2 GPUs (kernels/comm/NOTES.md).
    algorithm: force one algorithm (tests, benchmarks); None = chosen by size and world size.
    check_across_ranks: before the data moves, all-gather every rank's dtype, shape and local validity, so a
        mismatch (or a bad tensor on one rank) raises the same error on every rank instead of hanging or summing
        garbage. Costs one small collective per call; trusted hot loops may turn it off.
    shard_align_bytes: two-shot shard boundaries are multiples of this many bytes (64: 16 elements of fp32, 32 of
        bf16, so a shard length Triton specialises as divisible by 16 keeps the masked loads vectorised).
    use_symmetric_memory: CUDA tensors on an NCCL group go over symmetric memory (symm_mem.py); False sends them
        through the process group's all-gathers (same bits, NCCL's speed).
    sync: the symmetric-memory synchronisation (same bits either way; HOST_BARRIER is the fallback built only on
        torch's own barrier)."""

    one_shot_max_bytes: int = 512 * 1024
    one_shot_max_world: int = 4
    algorithm: Algorithm | None = None
    check_across_ranks: bool = True
    shard_align_bytes: int = 64
    use_symmetric_memory: bool = True
    sync: Sync = Sync.IN_KERNEL

    def __post_init__(self):
        if self.one_shot_max_bytes < 0:
            raise ValueError(f"AllReduceConfig.one_shot_max_bytes must be >= 0, got {self.one_shot_max_bytes}")
        if self.one_shot_max_world < 1:
            raise ValueError(f"AllReduceConfig.one_shot_max_world must be >= 1, got {self.one_shot_max_world}")
        if self.algorithm is not None and not isinstance(self.algorithm, Algorithm):
            raise TypeError(f"AllReduceConfig.algorithm must be an Algorithm or None, got {self.algorithm!r}")
        if not isinstance(self.sync, Sync):
            raise TypeError(f"AllReduceConfig.sync must be a Sync, got {self.sync!r}")
        a = self.shard_align_bytes
        if a < 1 or a & (a - 1):
            raise ValueError(f"AllReduceConfig.shard_align_bytes must be a power of two, got {a}")


DEFAULT_CONFIG = AllReduceConfig()


def choose_algorithm(nbytes: int, world_size: int, config: AllReduceConfig = DEFAULT_CONFIG) -> Algorithm:
    """The algorithm for a message of `nbytes` over `world_size` ranks (the same on every rank: same inputs)."""
    if config.algorithm is not None:
        return config.algorithm
    if nbytes <= config.one_shot_max_bytes and world_size <= config.one_shot_max_world:
        return Algorithm.ONE_SHOT
    return Algorithm.TWO_SHOT


def shard_size(numel: int, world_size: int, element_size: int, config: AllReduceConfig = DEFAULT_CONFIG) -> int:
    """Elements per two-shot shard: ceil(numel / W) rounded up to the alignment (the last shards may be short or
    empty; every element lies in exactly one shard)."""
    align = max(1, config.shard_align_bytes // element_size)
    per = -(-numel // world_size)
    return -(-per // align) * align


def shard_bounds(numel: int, world_size: int, element_size: int,
                 config: AllReduceConfig = DEFAULT_CONFIG) -> list[tuple[int, int]]:
    """[start, end) of shard r for r in 0..W-1, covering 0..numel exactly once."""
    s = shard_size(numel, world_size, element_size, config)
    return [(min(r * s, numel), min((r + 1) * s, numel)) for r in range(world_size)]
