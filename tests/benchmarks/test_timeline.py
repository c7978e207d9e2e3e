"""benchmarks/_timeline.py: the busy time and idle gaps that step_trace.py and moe.py's profile report -- overlaps
counted once, nested intervals not opening gaps, each gap named by the interval that had ended last before it."""
from benchmarks._timeline import busy_and_gaps


def test_union_and_gaps():
    busy, gaps = busy_and_gaps([(7, 9), (0, 5), (1, 3), (8, 12), (20, 21)])
    assert busy == 11  # [0, 5] + [7, 12] + [20, 21]
    assert gaps == [(2, 1, 0), (8, 3, 4)]  # (0, 5) then (7, 9); (8, 12) then (20, 21)


def test_no_gaps_when_contiguous_or_empty():
    assert busy_and_gaps([(0, 1), (1, 2), (0.5, 1.5)]) == (2, [])
    assert busy_and_gaps([]) == (0.0, [])
