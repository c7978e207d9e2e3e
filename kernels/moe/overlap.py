"""The shared experts beside the routed ones: a computation started on a side CUDA stream, so that its kernels
(the shared MLP's dense GEMMs, compute-bound) can run while the caller's stream runs the router, the permutation,
the FP8 quantisers and the combine (memory-bound) and fill the routed GEMMs' tails. Megatron-Core calls this
shared-expert overlap (`--moe-shared-expert-overlap`).

Numerics do not change: the same kernels run on the same inputs, only on another stream, so the bits are those
of the serial order. Autograd runs each op's backward on the stream its forward ran on and inserts the waits where
a gradient crosses streams (torch's "stream semantics of backward passes"), so the backward overlaps too.
On CPU, under torch.compile and during CUDA-graph capture the computation runs inline (serially).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch


@dataclasses.dataclass(frozen=True)
class StreamOverlap:
    """`enabled`: run beside (on a side stream) at all. `priority`: the side stream's CUDA priority (0 is the
    default streams' own, lower numbers are scheduled first when SMs free up)."""
    enabled: bool = True
    priority: int = 0


SERIAL = StreamOverlap(enabled=False)
_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}


def _side_stream(device: torch.device, priority: int) -> torch.cuda.Stream:
    key = (device.index if device.index is not None else torch.cuda.current_device(), priority)
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device=key[0], priority=priority)
    return _STREAMS[key]


def _inline(x: torch.Tensor, overlap: StreamOverlap) -> bool:
    return (not overlap.enabled or not x.is_cuda or torch.compiler.is_compiling()
            or torch.cuda.is_current_stream_capturing())


@dataclasses.dataclass
class Beside:
    """A result being computed on `stream` (None: already computed inline); `join()` hands it to the caller."""
    result: torch.Tensor
    stream: torch.cuda.Stream | None

    def join(self) -> torch.Tensor:
        """The result, usable on the caller's current stream (which now waits for the side stream)."""
        if self.stream is not None:
            current = torch.cuda.current_stream(self.result.device)
            current.wait_stream(self.stream)
            # the side stream's allocation is read on the caller's stream: not reused before that read is done
            self.result.record_stream(current)
            self.stream = None
        return self.result


def start_beside(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                 overlap: StreamOverlap = StreamOverlap()) -> Beside:
    """fn(x) started on a side stream after the work already queued on the caller's stream (x's producer)."""
    if _inline(x, overlap):
        return Beside(fn(x), None)
    side = _side_stream(x.device, overlap.priority)
    side.wait_stream(torch.cuda.current_stream(x.device))
    x.record_stream(side)  # x's memory is not reused while the side stream may still read it
    with torch.cuda.stream(side):
        out = fn(x)
    return Beside(out, side)
