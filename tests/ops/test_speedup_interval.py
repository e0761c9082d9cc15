"""bench/speedup_interval.py: the paired bootstrap interval that says whether a fused op's speedup is beyond
the run's noise."""
from __future__ import annotations

import random
import statistics

import pytest

from bench.speedup_interval import paired_ratio_interval, ratio_of_medians


def rounds(n: int, seed: int, unfused_cost: float, fused_cost: float, noise: float = 0.1,
           drift: float = 1.0) -> tuple[list[float], list[float]]:
    """(unfused, fused) call times of ``n`` interleaved rounds: each round's machine state (a factor between
    1 and 1 + ``drift``, as this VM drifts between fast and slow) scales both variants, and each call has its
    own ``noise`` (relative, uniform)."""
    rng = random.Random(seed)
    unfused, fused = [], []
    for _ in range(n):
        state = 1 + drift * rng.random()
        unfused.append(unfused_cost * state * (1 + noise * rng.uniform(-1, 1)))
        fused.append(fused_cost * state * (1 + noise * rng.uniform(-1, 1)))
    return unfused, fused


def test_ratio_of_medians() -> None:
    assert ratio_of_medians([4.0, 6.0, 5.0], [2.0, 3.0, 2.5]) == 2.0


def test_equal_variants_give_an_interval_around_one() -> None:
    """Over many runs of two variants that cost the same, the 95% interval holds 1 in about 95% of them (a
    single run may miss it: that is what 95% means)."""
    held = 0
    for seed in range(100):
        lo, hi = paired_ratio_interval(*rounds(150, seed, 4.0, 4.0), resamples=400, seed=seed)
        held += lo <= 1 <= hi
        assert hi - lo < 0.15, (seed, lo, hi)
    assert held >= 88, held


def test_a_real_loss_lies_below_one_and_a_real_gain_above() -> None:
    unfused, fused = rounds(300, 2, unfused_cost=4.4, fused_cost=4.0)  # fused 10% faster
    lo, hi = paired_ratio_interval(unfused, fused)
    assert 1 < lo <= ratio_of_medians(unfused, fused) <= hi < 1.2, (lo, hi)
    unfused, fused = rounds(300, 3, unfused_cost=4.0, fused_cost=4.4)  # fused 10% slower
    lo, hi = paired_ratio_interval(unfused, fused)
    assert 0.8 < lo <= hi < 1, (lo, hi)


def test_pairing_keeps_the_rounds_state() -> None:
    """A round's machine state hits both variants: resampling rounds keeps that, so the interval is narrower
    than with the two variants' rounds resampled independently (the same calls, the pairing shuffled)."""
    unfused, fused = rounds(300, 4, 4.0, 4.0, noise=0.05)
    lo, hi = paired_ratio_interval(unfused, fused)
    shuffled = fused[:]
    random.Random(5).shuffle(shuffled)
    lo_u, hi_u = paired_ratio_interval(unfused, shuffled)
    assert hi - lo < (hi_u - lo_u) / 2, ((lo, hi), (lo_u, hi_u))


def test_more_rounds_narrow_it_and_the_seed_fixes_it() -> None:
    few = paired_ratio_interval(*rounds(40, 6, 4.0, 4.0, 0.2))
    many = paired_ratio_interval(*rounds(1000, 6, 4.0, 4.0, 0.2))
    assert many[1] - many[0] < few[1] - few[0], (few, many)
    data = rounds(100, 7, 4.0, 3.0, 0.2)
    assert paired_ratio_interval(*data, seed=3) == paired_ratio_interval(*data, seed=3)
    lo99, hi99 = paired_ratio_interval(*data, level=0.99)
    lo90, hi90 = paired_ratio_interval(*data, level=0.90)
    assert lo99 <= lo90 <= statistics.median(data[0]) / statistics.median(data[1]) <= hi90 <= hi99


@pytest.mark.parametrize("args,match", [
    (([1.0, 2.0], [1.0]), "differ in length"),
    (([], []), "no rounds"),
    (([1.0], [1.0], 1.5), "level"),
    (([1.0], [1.0], 0.95, 0), "resamples"),
    (([1.0], [0.0]), "positive"),
])
def test_bad_input_is_refused(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        paired_ratio_interval(*args)
