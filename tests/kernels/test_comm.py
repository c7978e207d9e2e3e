"""The deterministic all-reduce (k3_kernels.comm) on CPU: gloo ranks spawned once (3 ranks; a pair group of ranks
0, 1 and the whole world), every result compared bit for bit with the spec (sum in rank order 0..W-1, fp32
accumulation, one rounding) on every rank and on a second run, one-shot vs two-shot vs the automatic choice; bad
input raising on every rank, naming the tensor, and leaving the group usable. The symmetric-memory Triton kernels
run here in Triton's interpreter over per-rank buffers of one process (the same pointer-table index math as on 2+
GPUs: tests/kernels/test_comm_gpu.py)."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from _comm_workers import DTYPES, GROUPS, SHAPES, algorithms, make_input, worker  # noqa: E402

from k3_kernels.comm import (Algorithm, AllReduceConfig, choose_algorithm, naive_all_reduce,  # noqa: E402
                             ordered_sum, shard_bounds)

WORLD = 3


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What every rank of one 3-rank gloo world returned (spawned once for the module: ~10 s of imports)."""
    d = tmp_path_factory.mktemp("comm")
    try:
        mp.start_processes(worker, args=(WORLD, str(d)), nprocs=WORLD, join=True, start_method="spawn")
    except Exception:
        errs = [p.read_text() for p in sorted(d.glob("rank*.err"))]
        raise AssertionError("a rank failed:\n" + "\n".join(errs))
    return [torch.load(d / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def members(gname: str) -> tuple:
    return GROUPS[gname] or tuple(range(WORLD))


def cases():
    return [(g, dt, s, a) for g in GROUPS for dt in DTYPES for s in SHAPES for a in algorithms()]


def test_every_rank_gets_the_spec_bits(ranks):
    """Each rank's result == naive_all_reduce of all members' inputs, bit for bit, for every group, dtype, shape
    (sizes not divisible by 2 or 3, 2-D, empty) and algorithm."""
    for g, dtype, shape, a in cases():
        spec = naive_all_reduce([make_input(r, shape, dtype) for r in members(g)])
        for r in members(g):
            got = ranks[r]["results"][(g, str(dtype), shape, a)]
            assert same_bits(got, spec), (g, dt, shape, a, r)


def test_repeat_runs_and_algorithms_agree(ranks):
    """A second call returns the same bits and leaves the input alone; one-shot, two-shot and auto agree."""
    for g, dtype, shape, a in cases():
        dt = str(dtype)
        for r in members(g):
            assert ranks[r]["repeat_equal"][(g, dt, shape, a)], (g, dt, shape, a, r)
            ref = ranks[r]["results"][(g, dt, shape, "one_shot")]
            assert same_bits(ranks[r]["results"][(g, dt, shape, a)], ref)


def test_inputs_make_the_order_visible():
    """The bitwise checks have teeth: over 3 ranks these fp32 inputs sum to other bits in another order (a path
    that reordered its sum would fail the tests above), and these bf16 inputs to other bits when each partial sum
    is rounded to bf16 (a path accumulating in bf16 would fail). (A reordered fp32 accumulation of 3 bf16 inputs
    rounds to the same bf16 bits almost always: the order shows in bf16 only through the accumulator.)"""
    f32 = [make_input(r, (1001,), torch.float32) for r in range(WORLD)]
    assert not same_bits(ordered_sum(f32[::-1], torch.float32), naive_all_reduce(f32))
    bf16 = [make_input(r, (1001,), torch.bfloat16) for r in range(WORLD)]
    assert not same_bits((bf16[0] + bf16[1]) + bf16[2], naive_all_reduce(bf16))


def test_bad_input_raises_on_every_rank_naming_the_tensor(ranks):
    errs = [ranks[r]["errors"] for r in range(WORLD)]
    for kind in ("shape", "dtype", "non_contiguous", "int_dtype"):
        msgs = {e[kind] for e in errs}
        assert all("grad" in m for m in msgs), (kind, msgs)
        assert all(m.startswith("TypeError" if kind == "int_dtype" else "ValueError") for m in msgs), (kind, msgs)
    assert "rank 1: torch.float32[8]" in errs[0]["shape"] and "rank 0: torch.float32[7]" in errs[2]["shape"]
    assert "rank 2: torch.bfloat16[7]" in errs[1]["dtype"]
    assert all("not contiguous on rank(s) [0]" in e["non_contiguous"] for e in errs)
    assert "stride [1, 4]" in errs[0]["non_contiguous"]  # the rank holding the bad view says what it is
    assert all(e["not_tensor"].startswith("TypeError: all_reduce: grad must be a torch.Tensor") for e in errs)
    assert all(e["local_only"].startswith("ValueError: all_reduce: grad is not contiguous") for e in errs)


def test_group_still_works_after_bad_input(ranks):
    spec = naive_all_reduce([make_input(r, (7,), torch.float32, salt=1) for r in range(WORLD)])
    for r in range(WORLD):
        assert same_bits(ranks[r]["errors"]["after"], spec)


def test_choice_by_size_and_world_size():
    c = AllReduceConfig(one_shot_max_bytes=1024, one_shot_max_world=4)
    assert choose_algorithm(1024, 2, c) is Algorithm.ONE_SHOT
    assert choose_algorithm(1025, 2, c) is Algorithm.TWO_SHOT
    assert choose_algorithm(8, 8, c) is Algorithm.TWO_SHOT
    assert choose_algorithm(1 << 30, 2, AllReduceConfig(algorithm=Algorithm.ONE_SHOT)) is Algorithm.ONE_SHOT
    with pytest.raises(ValueError, match="shard_align_bytes"):
        AllReduceConfig(shard_align_bytes=12)
    with pytest.raises(TypeError, match="algorithm"):
        AllReduceConfig(algorithm="one_shot")


@pytest.mark.parametrize("n,world", [(0, 2), (1, 3), (7, 2), (1001, 3), (4096, 4), (5, 8)])
def test_shards_cover_every_element_once(n, world):
    for es in (2, 4):
        bounds = shard_bounds(n, world, es)
        covered = [i for s, e in bounds for i in range(s, e)]
        assert covered == list(range(n))
        assert all(s * es % 16 == 0 for s, e in bounds if e > s)


def _buffers(parts, dtype, offset):
    """Per-rank buffers as symm_mem lays them out: `offset` elements, the input, a shard region."""
    n = parts[0].numel()
    bufs = [torch.zeros(offset + 2 * n + 16, dtype=dtype) for _ in parts]
    for b, p in zip(bufs, parts):
        b[offset:offset + n] = p.reshape(-1)
    return bufs, torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_symm_mem_kernels_in_the_interpreter(world, dtype):
    """peer_sum's kernels over W per-rank buffers reached through a pointer table: one-shot on every rank, and
    two-shot (every rank's stage 1, then every rank's stage 2: the barrier's order) equal the spec bit for bit."""
    from k3_kernels.comm import peer_sum
    from k3_kernels.comm.plan import shard_size

    for n in (1, 1001, 2 * peer_sum.BLOCK + 3):
        parts = [make_input(r, (n,), dtype, salt=2) for r in range(world)]
        spec = naive_all_reduce(parts)
        off = 24
        bufs, ptrs = _buffers(parts, dtype, off)
        shard_at = off + n
        size = shard_size(n, world, parts[0].element_size())
        for r, (s, e) in enumerate(shard_bounds(n, world, parts[0].element_size())):
            peer_sum.reduce_shard(ptrs, off, bufs[r][shard_at:shard_at + size], s, e)
        for r in range(world):
            one, two = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
            peer_sum.one_shot(ptrs, off, one)
            peer_sum.gather_shards(ptrs, shard_at, two, size)
            assert same_bits(one, spec) and same_bits(two, spec), (n, r)
