"""Device timelines from profiler events: the union of kernels' intervals and the gaps between its pieces (what the
device was idle for), shared by benchmarks/step_trace.py and benchmarks/moe.py's profile."""
from __future__ import annotations


def busy_and_gaps(intervals: list[tuple[float, float]]) -> tuple[float, list[tuple[float, int, int]]]:
    """[(start, end)] -> (the length of their union, its gaps as (length, i, j)): i indexes the interval that had
    ended last before the gap, j the one that ends it (indices into `intervals`)."""
    busy, gaps, end, last = 0.0, [], float("-inf"), -1
    for i in sorted(range(len(intervals)), key=lambda n: intervals[n]):
        a, b = intervals[i]
        if last >= 0 and a > end:
            gaps.append((a - end, last, i))
        if b > end:
            busy += b - max(a, end)
            end, last = b, i
    return busy, gaps
