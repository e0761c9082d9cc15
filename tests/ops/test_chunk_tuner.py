"""The automatic chunk count's tuner (csrc/kernels/pipeline.h, Tuner): each candidate is timed on real calls in
turn, then the one with the lowest median time is used. Checked through superkernel._C.tuner_pick, which runs
the tuner's own code on given timings."""
from __future__ import annotations

import pytest

from superkernel import _C

TRIALS = 3  # Tuner::kTrials


def test_candidates_in_turn_until_each_is_timed() -> None:
    cands = [2, 1, 4]
    assert _C.tuner_pick(cands, [[], [], []]) == 2
    assert _C.tuner_pick(cands, [[1.0], [], []]) == 1
    assert _C.tuner_pick(cands, [[1.0], [1.0], []]) == 4
    # one call short of 3 per candidate: still in turn (the ninth call goes to the third candidate)
    assert _C.tuner_pick(cands, [[1.0] * TRIALS, [1.0] * TRIALS, [1.0] * (TRIALS - 1)]) == 4


def test_lowest_median_not_fastest_call() -> None:
    """The shape of a measured case (Gloo between two namespace hosts, fp16 allgather_gemm 512^3): the
    candidate with the fastest single call has the worse typical time."""
    cands = [1, 2, 4]
    secs = [[7.9e-3, 7.8e-3, 8.0e-3], [5.9e-3, 8.2e-3, 8.1e-3], [6.3e-3, 9.6e-3, 9.0e-3]]
    assert _C.tuner_pick(cands, secs) == 1
    secs[2] = [7.0e-3, 7.1e-3, 20.0e-3]  # one slow outlier does not disqualify a candidate
    assert _C.tuner_pick(cands, secs) == 4


def test_equal_medians_take_fewer_chunks() -> None:
    assert _C.tuner_pick([4, 1, 2], [[5e-3] * TRIALS] * 3) == 1


def test_rejects_mismatched_timings() -> None:
    with pytest.raises(RuntimeError, match="one list of timings per candidate"):
        _C.tuner_pick([1, 2], [[1.0]])
