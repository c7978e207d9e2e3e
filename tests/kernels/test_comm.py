"""The deterministic all-reduce (k3_kernels.comm) on CPU: gloo ranks spawned once (3 ranks; groups of rank 0 alone,
of ranks 0, 1 and the whole world), every result compared bit for bit with the spec (sum in rank order 0..W-1, fp32
accumulation, one rounding) on every rank and on a second run, one-shot vs two-shot vs the automatic choice; bad
input raising on every rank, naming the tensor, and leaving the group usable. The symmetric-memory Triton kernels
run here in Triton's interpreter over per-rank buffers of one process (the same pointer-table index math as on 2+
GPUs: tests/kernels/test_comm_gpu.py)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _comm_workers import DTYPES, GROUPS, SHAPES, algorithms, make_input, run_battery  # noqa: E402
from _spawned_ranks import spawn_ranks  # noqa: E402

from k3_kernels.comm import (Algorithm, AllReduceConfig, choose_algorithm, naive_all_reduce,  # noqa: E402
                             ordered_sum, shard_bounds)

WORLD = 3
BLOCK = 64  # the kernels' block in the interpreter tests (peer_sum.BLOCK on GPUs): several blocks per program


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What every rank of one 3-rank gloo world returned (spawned once for the module: ~10 s of imports)."""
    d = tmp_path_factory.mktemp("comm")
    return spawn_ranks(run_battery, WORLD, d)


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
            assert same_bits(got, spec), (g, dtype, shape, a, r)


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


def test_symm_mem_path_imports_without_a_gpu():
    """symm_mem.py (the CUDA path) imports here: its torch and Triton APIs exist in the pinned versions."""
    from k3_kernels.comm import symm_mem

    assert callable(symm_mem.all_reduce_symm_mem) and symm_mem.Workspace.view


@pytest.mark.parametrize("n,world", [(0, 2), (1, 3), (7, 2), (1001, 3), (4096, 4), (5, 8)])
def test_shards_cover_every_element_once(n, world):
    for es in (2, 4):
        bounds = shard_bounds(n, world, es)
        covered = [i for s, e in bounds for i in range(s, e)]
        assert covered == list(range(n))
        assert all(s * es % 16 == 0 for s, e in bounds if e > s)


def _buffers(world, n, dtype, offset):
    """Per-rank zeroed buffers laid out as symm_mem's slot 1 (`offset` elements, input region, shard region), each
    rank's element deltas to the others', and dummy signal pads (the interpreter runs the stages rank after rank
    instead of meeting)."""
    from k3_kernels.comm.peer_sum import peer_deltas

    bufs = [torch.zeros(offset + 2 * n + 64, dtype=dtype) for _ in range(world)]
    bases = [b.data_ptr() for b in bufs]
    deltas = [torch.tensor(peer_deltas(bases, r, bufs[0].element_size())) for r in range(world)]
    return bufs, deltas, torch.zeros(world, dtype=torch.int64)


@pytest.mark.parametrize("world,dtype", [(2, torch.float32), (3, torch.float32), (4, torch.float32),
                                         (3, torch.bfloat16), (4, torch.bfloat16), (3, torch.float16)], ids=str)
def test_symm_mem_kernels_in_the_interpreter(world, dtype):
    """peer_sum's kernels over W per-rank buffers reached through a pointer table, each stage run on every rank
    before the next (the order the meetings enforce on GPUs): one-shot and two-shot equal the spec bit for bit on
    every rank, with 2 programs over 3 blocks of every shard (persistent loops) and more programs than blocks."""
    from k3_kernels.comm import peer_sum
    from k3_kernels.comm.plan import shard_size

    for n, programs in ((1, 3), (2 * BLOCK * world + 3, 2)):
        xs = [make_input(r, (n,), dtype, salt=2) for r in range(world)]
        spec = naive_all_reduce(xs)
        off = 24
        shard = shard_size(n, world, xs[0].element_size())
        outs = [torch.empty(n, dtype=dtype) for _ in range(world)]
        bufs, deltas, pads = _buffers(world, n, dtype, off)
        for r in range(world):
            peer_sum.one_shot(xs[r], bufs[r], deltas[r], pads, off, outs[r], r, programs, reduce=False, sync=False,
                              block=BLOCK)
        for r in range(world):
            peer_sum.one_shot(xs[r], bufs[r], deltas[r], pads, off, outs[r], r, programs, copy_in=False, sync=False,
                              block=BLOCK)
            assert same_bits(outs[r], spec), ("one-shot", n, r)
        outs = [torch.empty(n, dtype=dtype) for _ in range(world)]
        bufs, deltas, pads = _buffers(world, n, dtype, off)
        stages = ({"reduce": False, "gather": False}, {"copy_in": False, "gather": False},
                  {"copy_in": False, "reduce": False})
        for stage in stages:
            for r in range(world):
                peer_sum.two_shot(xs[r], bufs[r], deltas[r], pads, off, off + n, outs[r], shard, r, programs,
                                  sync=False, block=BLOCK, **stage)
        for r in range(world):
            assert same_bits(outs[r], spec), ("two-shot", n, r)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_meeting_protocol_in_the_interpreter(world):
    """The in-kernel meeting's signal slots: with every peer's signal already posted to this rank (slot
    [p W + q] of its own pad = 1 for each program p and peer q), a one-shot launch with SYNC consumes them all
    (back to 0), posts exactly one signal to each peer (slot [p W + rank] of peer q's pad = 1), touches nothing
    else, and still returns the spec's bits. (The waiting itself, across GPUs, is what test_comm_gpu.py runs.)"""
    from k3_kernels.comm import peer_sum

    n, programs, off = 3 * BLOCK + 1, 3, 8
    xs = [make_input(r, (n,), torch.float32, salt=3) for r in range(world)]
    spec = naive_all_reduce(xs)
    bufs, deltas, _ = _buffers(world, n, torch.float32, off)
    pads_mem = [torch.zeros(programs * world + 4, dtype=torch.int32) for _ in range(world)]
    pads = torch.tensor([p.data_ptr() for p in pads_mem], dtype=torch.int64)
    for r in range(world):
        peer_sum.one_shot(xs[r], bufs[r], deltas[r], pads, off, torch.empty(n), r, programs, reduce=False, sync=False,
                          block=BLOCK)
    for r in range(world):
        incoming = [(p * world + q) for p in range(programs) for q in range(world) if q != r]
        pads_mem[r][incoming] = 1
        out = torch.empty(n)
        peer_sum.one_shot(xs[r], bufs[r], deltas[r], pads, off, out, r, programs, block=BLOCK)
        assert same_bits(out, spec)
        assert int(pads_mem[r].sum()) == 0, "incoming signals not all consumed"
        for q in range(world):
            if q == r:
                continue
            posted = torch.zeros_like(pads_mem[q])
            posted[[p * world + r for p in range(programs)]] = 1
            assert torch.equal(pads_mem[q], posted), (r, q, pads_mem[q])
            pads_mem[q].zero_()


def test_kernels_compile_for_the_h200():
    """The symmetric-memory kernels compile for sm_90 here (no GPU needed): peer loads are 16-byte vectors that
    bypass L1 (ld.global.cg.v4), the meetings are release / acquire compare-and-swaps at system scope, and there
    is no multimem instruction and no other atomic (NVLink multicast stays off; sums are in registers, in order)."""
    import json
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import json, _comm_workers as w; print(json.dumps(w.ptx_summary()))"
    run = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(__file__), env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    for kernel, ops in summary.items():
        assert not [op for op in ops if op.startswith(("multimem", "red."))], (kernel, ops)
        assert set(op for op in ops if op.startswith("atom")) == {"atom.global.release.sys.cas.b32",
                                                                   "atom.global.acquire.sys.cas.b32"}, (kernel, ops)
        assert ops.get("ld.global.cg.v4.b32", 0) >= 3, (kernel, ops)  # W = 3 peers' loads, vectorised
        assert not [op for op in ops if op.startswith("ld.global.cg") and "v4" not in op], (kernel, ops)


class _FakeSymm:
    """Stands in for torch.distributed._symmetric_memory with W threads of one process as the ranks: `empty` is
    host memory, `rendezvous` exchanges the buffers' addresses (and fresh signal pads) between the threads, and the
    handle's `barrier` is a thread barrier. Enough to run symm_mem.py's own logic (workspace, slots, offsets,
    regrowth, plans) with Sync.HOST_BARRIER over the interpreter."""

    def __init__(self, world: int):
        import threading

        self.world, self.barrier = world, threading.Barrier(world)
        self.local, self.posted, self.lock = threading.local(), {}, threading.Lock()

    def empty(self, size, dtype, device):
        return torch.zeros(size, dtype=dtype)

    def rendezvous(self, buffer, group_name):
        rank = self.local.rank
        with self.lock:
            self.posted[rank] = buffer
        self.barrier.wait()
        ptrs = [self.posted[r].data_ptr() for r in range(self.world)]
        self.barrier.wait()
        fake = self

        class Handle:
            def __init__(self):
                self.rank, self.world_size, self.buffer_ptrs = rank, fake.world, ptrs
                self.buffer_size = buffer.numel()
                self.pads = [torch.zeros(256, dtype=torch.int32) for _ in range(fake.world)]
                self.signal_pad_ptrs, self.signal_pad_size = [p.data_ptr() for p in self.pads], 1024

            def barrier(self, channel=0):
                fake.barrier.wait()
        return Handle()


def test_symm_mem_orchestration_on_cpu_threads(monkeypatch):
    """symm_mem.py's host logic end to end on CPU: 3 thread-ranks call all_reduce_symm_mem back to back (both
    algorithms, slots alternating, a message past the first 1 MiB capacity regrowing the workspace), with the
    kernels in the interpreter (one launch at a time) and torch's barrier played by a thread barrier; every
    result equals the spec bit for bit."""
    import threading

    from k3_kernels.comm import Sync, peer_sum, symm_mem

    world = 3
    fake = _FakeSymm(world)
    monkeypatch.setattr(symm_mem, "symm", fake)
    monkeypatch.setattr(symm_mem, "_workspaces", {})
    monkeypatch.setattr(symm_mem, "_plans", {})
    monkeypatch.setattr(symm_mem, "_retired", [])
    launch_lock = threading.Lock()
    def one_at_a_time(launch):
        def run(*args, **kwargs):
            with launch_lock:
                launch(*args, **kwargs)
        return run

    for name in ("_launch_one_shot", "_launch_two_shot"):
        monkeypatch.setattr(peer_sum, name, one_at_a_time(getattr(peer_sum, name)))

    class Group:
        group_name = "fake"

    calls = [(Algorithm.ONE_SHOT, 1001, 0), (Algorithm.TWO_SHOT, 1001, 1), (Algorithm.TWO_SHOT, 1001, 2),
             (Algorithm.ONE_SHOT, 7, 3), (Algorithm.TWO_SHOT, (1 << 18) + 40, 4), (Algorithm.ONE_SHOT, 1001, 5)]
    results, errors = {}, []

    def rank_main(rank):
        try:
            fake.local.rank = rank
            group = Group()
            for algo, n, salt in calls:
                x = make_input(rank, (n,), torch.float32, salt=10 + salt)
                config = AllReduceConfig(algorithm=algo, sync=Sync.HOST_BARRIER, check_across_ranks=False)
                results[(rank, salt)] = symm_mem.all_reduce_symm_mem(x, group, algo, config)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append((rank, repr(e)))
            fake.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for algo, n, salt in calls:
        spec = naive_all_reduce([make_input(r, (n,), torch.float32, salt=10 + salt) for r in range(world)])
        for r in range(world):
            assert same_bits(results[(r, salt)], spec), (algo, n, salt, r)
    assert len(symm_mem._retired) == world  # each rank's first workspace retired by the regrowth
