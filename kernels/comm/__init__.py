"""Deterministic all-reduce (`all_reduce`): one-shot / two-shot over torch symmetric memory on CUDA, the process
group's all-gathers elsewhere (gloo on CPU), all summing in rank order 0..W-1 (`naive_all_reduce`, the spec).
Imports no Triton: the symmetric-memory path loads its kernels on first CUDA use."""
from .allreduce import all_reduce
from .naive import naive_all_reduce, ordered_sum
from .plan import Algorithm, AllReduceConfig, Sync, choose_algorithm, shard_bounds

__all__ = ["Algorithm", "AllReduceConfig", "all_reduce", "choose_algorithm", "naive_all_reduce", "ordered_sum",
           "shard_bounds", "Sync"]
