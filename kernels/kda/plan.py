"""Host side of the chunked KDA kernels: launch settings (CONFIG, no autotuning, so the interpreter and the GPU
run the same configs), dot precisions, the state passes' V split, the packed batch's chunk plan and sequence
classes, and the side streams the forward forks its state passes onto."""
from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import torch

from k3_kernels.launch import cdiv, next_pow2, num_sms

BT = 64  # chunk size

# launch settings (no autotuning, so the interpreter and the GPU run the same configs)
CONFIG = {"fwd_state_bv": None, "fwd_state_warps": 4, "fwd_state_stages": 3,  # bv None: by parallelism
          # a packed batch's classes (`_state_classes`, at most `state_classes`, read when a batch's plan is first
          # built): the passes of all but the last forked beside the later classes' work (`_fwd`), and the last's
          # (None: by parallelism, as above)
          "state_classes": 3, "fwd_state_forked_bv": 64, "fwd_state_forked_stages": 2, "fwd_state_rest_bv": None,
          "fwd_state_rest_stages": None,
          # a class of one sequence split into `fwd_segments` time segments (1: not split) of at least
          # `fwd_segment_chunks` chunks and `fwd_segment_programs` (chunk, head) programs (fewer left the intra
          # launches part-filled: 16K at H16 slower; kernels/kda/NOTES.md, session 39): segment s's state pass runs
          # on a side stream while segment s + 1's intra work runs on the current one (`_fwd`, `segment_bounds`);
          # the segmented pass's V block and stages (None: by parallelism, as above)
          "fwd_segments": 4, "fwd_segment_chunks": 16, "fwd_segment_programs": 6144, "fwd_state_segmented_bv": None,
          "fwd_state_segmented_stages": None,
          # the backward's: a batch of one sequence cut so, segment s's chunk work beside segment s - 1's reverse pass
          # (off: measured no faster, session 39)
          "bwd_segments": 1, "bwd_segment_chunks": 16, "bwd_state_segmented_bv": None,
          "bwd_state_segmented_stages": None,
          "bwd_state_bv": None, "bwd_state_warps": 4, "bwd_state_stages": 3,  # (`_state_split`)
          "intra_bk": 32, "intra_warps": 4, "intra_stages": 3, "intra_maxnreg": None,  # the 16-row-block launch
          "intra_whole_warps": 4, "intra_whole_stages": 3, "intra_whole_maxnreg": 168,  # its whole-chunk launch
          "bwd_intra_bk": 32, "bwd_intra_warps": 4, "bwd_intra_stages": 2,
          "bwd_prep_bv": 64, "bwd_prep_warps": 4, "bwd_prep_stages": 1, "ka": 32,
          "dot_precision": None,  # None: by input dtype and kernel (`_prec`); or force one of triton's everywhere
          "bwd_intra_precision": None, "bwd_prep_precision": None,  # per kernel, 16-bit inputs (None: TF32)
          "gate_bwd": "triton"}  # the in-kernel gate's backward: gate.py's pass, or "torch" (autograd, the A/B)


def pow2_tile(x: int) -> int:
    """The power-of-two tile width covering x, at least 16 (tl.dot's smallest)."""
    return max(16, next_pow2(x))


def _prec(dtype: torch.dtype, kernel: str | None = None) -> str:
    """fp32 dot precision: CONFIG["dot_precision"] if set; else near-fp32 (3xTF32) for fp32 inputs; for 16-bit
    inputs CONFIG["<kernel>_precision"] where set, else TF32 (the backward intra kernel rounds its operands once for
    both sides of each gradient pair, `_rounded`, which is what makes TF32 accurate enough there)."""
    if CONFIG["dot_precision"] is not None:
        return CONFIG["dot_precision"]
    if dtype == torch.float32:
        return "tf32x3"
    return (CONFIG.get(f"{kernel}_precision") if kernel else None) or "tf32"


SHARED_LIMIT = 232448  # bytes of shared memory a block may take on the H200 (Hopper)


def tile_dims(K: int, V: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int]:
    """(BK, BVF): the padded head dims of the chunk-layout intermediates and the kernels' tiles. Powers of two
    (masked past K / V); on CUDA with 16-bit inputs at least 128: with fewer than three 32-wide slices in the intra
    kernel's W / U loops (K or V <= 64) Triton 3.6's sm_90 build of the 16-bit W / U dots read shared memory out of
    bounds (compute-sanitizer memcheck, H200: K = 60 -> 64, and K = V = 16), as a 1-stage build of them did in an
    earlier session (kernels/kda/NOTES.md); 128, the layout of every measured row, is the one known good. The
    interpreter keeps the plain powers of two."""
    BK, BVF = pow2_tile(K), pow2_tile(V)
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        BK, BVF = max(BK, 128), max(BVF, 128)
    return BK, BVF


def state_stages(stages: int, BK: int, BV: int, elsize: int) -> int:
    """The state passes' pipeline depth: at most `stages`, and as many as fit in shared memory, each stage buffering
    a chunk's three [64, BK] operands, its [64, 64] Aqk, a [64, BV] tile and G's last row (offline sm_90a builds,
    K = V = 256, bf16, V block 32: 354,304 bytes at 3 stages, 242,688 at 2, 126,976 at 1, i.e. 111,616 per stage as
    counted here plus ~20 KB; fp32 at K = 128 with 2 stages asked for 259,072 on the H200). 32 KB is kept for the
    rest. 16-bit inputs with V blocks under 64 get at least 2: Triton 3.6's one-stage sm_90 build of the forward
    pass gave NaN (V block 16) or an illegal address (32) on an H100 (kernels/kda/NOTES.md, session 39; V block
    64 and fp32 inputs were right at one stage), so an override asking for one is raised to two where two fit (at
    K <= 128, CUDA's limit, they always do)."""
    per_stage = (3 * 64 * BK + 64 * 64 + 64 * BV) * elsize + 4 * BK
    fit = (SHARED_LIMIT - 32768) // per_stage
    count = min(stages, fit)
    if elsize == 2 and BV < 64:
        count = max(count, min(2, fit))
    return max(1, count)


def _state_split(direction: str, states: int, K: int, V: int, BK: int, BVF: int, elsize: int,
                 device: torch.device) -> tuple[int, int]:
    """(V block, pipeline stages) of the serial state pass, one program per (sequence, head, V block). Every
    program reloads its chunk's [64, K] operands, so wider blocks cut that traffic and narrower ones add programs:
    the widest block that still gives half the multiprocessors a program (the H200 sweep that chose it:
    benchmarks/results/kda.json `variants_session5.state_bv_sweep_ms`, kernels/kda/NOTES.md). CONFIG's
    `<direction>_state_bv` overrides it (the benchmark's sweep)."""
    forced = CONFIG[f"{direction}_state_bv"]
    if forced is not None:
        bv = min(forced, BVF)
        return bv, state_stages(CONFIG[f"{direction}_state_stages"], BK, bv, elsize)
    sms = num_sms(device)  # (state tiles no larger than the measured [128, 64]: K > 128 keeps them narrower)
    bv = next((b for b in (64, 32) if 2 * states * cdiv(V, b) >= sms and BK * b <= 128 * 64), 16)
    bv = min(bv, BVF)
    return bv, state_stages(2 if bv == 64 else CONFIG[f"{direction}_state_stages"], BK, bv, elsize)


def state_grid(count: int, HV: int, V: int, BV: int) -> tuple[int, int]:
    """The state passes' grid: axis 0 runs over (sequence, V block) with the V blocks fastest, axis 1 over value
    heads (`utils._state_program` reads it back). A head's V blocks read the same [64, K] chunk operands; as
    adjacent programs they start together, so all but the first find those operands in L2 (with the V blocks the
    slowest axis a block of the same head could start a whole wave later)."""
    return count * cdiv(V, BV), HV


class SeqClass(NamedTuple):
    """One class of `_state_classes`: its sequences (int32, on the device), how many (a class of one can be cut
    into time segments, `segment_bounds`), its first chunk and chunk count (its chunks are one range of the plan's
    numbering)."""
    seqs: torch.Tensor
    count: int
    first_chunk: int
    chunks: int


def segment_bounds(cls: SeqClass, segments: int, least: int) -> list[tuple[int, int]]:
    """[(first, end)) chunk ranges, within the class's sequence, of its time segments: `segments` near-equal ones
    of at least `least` chunks when the class has a single sequence, else the whole class as one range."""
    parts = min(segments, cls.chunks // max(least, 1)) if cls.count == 1 else 1
    if parts <= 1:
        return [(0, cls.chunks)]
    cuts = [cls.chunks * s // parts for s in range(parts + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def forward_segments(cls: SeqClass, heads: int) -> list[tuple[int, int]]:
    """The forward's time segments of a class (CONFIG `fwd_segments`): each at least `fwd_segment_chunks` chunks
    and `fwd_segment_programs` intra programs (chunks x value heads)."""
    least = max(CONFIG["fwd_segment_chunks"], cdiv(CONFIG["fwd_segment_programs"], heads))
    return segment_bounds(cls, CONFIG["fwd_segments"], least)


@functools.lru_cache(maxsize=32)
def _chunk_plan(cu: tuple[int, ...] | None, B: int, T: int, device: torch.device) -> tuple:
    """(cu_seqlens int64 [N+1], chunk -> (sequence, chunk in sequence) int32 [NC, 2], each sequence's first chunk
    int32 [N], the `SeqClass`es of `_state_classes`), cached by content: every KDA layer of a model step sees the
    same batch, and building a packed plan of 8 sequences / 512 chunks costs ~0.1 ms of host time. Chunks are
    numbered class by class, so that a class's chunks are one range for the forward's per-class launches (`_fwd`).
    Fixed-length batches are built on the device (no host sync), packed ones from the host tuple. The kernels only
    read it."""
    if cu is None:
        nt = cdiv(T, BT)
        c = torch.arange(B * nt, device=device, dtype=torch.int32)
        return (torch.arange(B + 1, device=device, dtype=torch.int64) * T,
                torch.stack([c // nt, c % nt], 1).contiguous(),
                torch.arange(B, device=device, dtype=torch.int32) * nt,
                (SeqClass(torch.arange(B, device=device, dtype=torch.int32), B, 0, B * nt),))
    counts = [cdiv(cu[i + 1] - cu[i], BT) for i in range(len(cu) - 1)]
    pairs, first, classes = [], [0] * len(counts), []
    for group in _state_classes(counts, CONFIG["state_classes"]):
        start = len(pairs)
        for i in group:
            first[i] = len(pairs)
            pairs.extend((i, t) for t in range(counts[i]))
        classes.append(SeqClass(torch.tensor(group, dtype=torch.int32).to(device, non_blocking=True), len(group),
                                start, len(pairs) - start))
    cidx = torch.tensor(pairs, dtype=torch.int32).view(-1, 2)
    return tuple(x.to(device, non_blocking=True) for x in (torch.tensor(cu, dtype=torch.int64), cidx,
                                                           torch.tensor(first, dtype=torch.int32))) + (tuple(classes),)


def _state_classes(chunks: list[int], most: int) -> list[list[int]]:
    """Sequences grouped by length for the serial state passes, longest first: each class holds the sequences at
    least half as long as its longest (their chains set the pass's time), at most `most` classes, the last taking
    every sequence left (empty ones too: they still get their state, h0 -> ht). Each class gets its own V block
    (`_state_split`): a long sequence keeps narrow blocks and many programs per head, many short ones take wide
    blocks that reload their operands fewer times; the forward starts a class's pass as soon as its own intra work
    is done (`_fwd`), the backward runs all classes' passes at once (`_bwd`). Outputs do not depend on the grouping
    (bitwise, any V block)."""
    left = [i for i, c in enumerate(chunks) if c > 0]
    classes = []
    while left and len(classes) < most - 1:
        longest = max(chunks[i] for i in left)
        top = [i for i in left if 2 * chunks[i] >= longest]
        if len(top) == len(left):
            break
        classes.append(top)
        left = [i for i in left if 2 * chunks[i] < longest]
    rest = sorted(left + [i for i, c in enumerate(chunks) if c == 0])
    return classes + ([rest] if rest else [])


_STREAMS: dict = {}


def _side_stream(device: torch.device, index: int) -> torch.cuda.Stream:
    """The device's high-priority side stream number `index`, made once (its blocks are placed first as
    multiprocessors free up)."""
    if (device, index) not in _STREAMS:
        _STREAMS[device, index] = torch.cuda.Stream(device, priority=-1)
    return _STREAMS[device, index]


@contextlib.contextmanager
def _forked(fork: bool, device: torch.device, index: int):
    """With `fork` (on CUDA), launches inside go to side stream `index`, after the work queued so far; the caller
    joins it (`_join`) once its own later launches are queued, so they overlap. Otherwise (and in the CPU
    interpreter) they stay on the current stream."""
    if not fork or device.type != "cuda":
        yield
        return
    side = _side_stream(device, index)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        yield


def _join(device: torch.device, streams) -> None:
    """The current stream waits for the side streams numbered in `streams` (`_forked`; nothing off CUDA)."""
    if device.type != "cuda":
        return
    for i in streams:
        torch.cuda.current_stream(device).wait_stream(_side_stream(device, i))


def _record(device: torch.device) -> torch.cuda.Event | None:
    """An event recorded on the current stream (inside `_forked`: the side stream's work so far); None off CUDA."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _wait(device: torch.device, event: torch.cuda.Event | None) -> None:
    """The current stream waits for `event` (`_record`; None: nothing to wait for)."""
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)
