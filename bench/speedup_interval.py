"""How sure a speedup is: a paired bootstrap interval for a ratio of medians over interleaved rounds.

``bench/fused_ops.py`` times each variant once per round, in a new order every round, and reports the
speedup as median(unfused) / median(fused). On the shared 2-core VM the call times of one variant spread by
half or more between its quarter points (the machine drifts between fast and slow states lasting seconds),
so one run's ratio of medians moves by 5-15% between runs. Resampling whole rounds (the same round indices
for both variants) keeps what a round's machine state did to both, and gives the range the ratio would
take over repeated runs of the same rounds: a speedup whose interval lies below 1 is slower than unfused
beyond this run's noise.
"""
from __future__ import annotations

import random
import statistics
from collections.abc import Sequence


def ratio_of_medians(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """median(numerator) / median(denominator), e.g. unfused times over fused times: the speedup."""
    return statistics.median(numerator) / statistics.median(denominator)


def paired_ratio_interval(numerator: Sequence[float], denominator: Sequence[float], level: float = 0.95,
                          resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The percentile bootstrap interval of ``ratio_of_medians`` at ``level``, resampling round indices
    (``numerator[i]`` and ``denominator[i]`` come from the same round). Deterministic for a given ``seed``."""
    if len(numerator) != len(denominator):
        raise ValueError(f"paired samples differ in length: {len(numerator)} rounds against {len(denominator)}")
    if not numerator:
        raise ValueError("no rounds to resample")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if resamples < 1:
        raise ValueError(f"resamples must be at least 1, got {resamples}")
    if min(denominator) <= 0:
        raise ValueError("denominator samples must be positive (call times)")
    rng = random.Random(seed)
    n = len(numerator)
    ratios = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        ratios.append(ratio_of_medians([numerator[i] for i in idx], [denominator[i] for i in idx]))
    ratios.sort()
    tail = (1 - level) / 2
    lo = ratios[min(resamples - 1, int(tail * resamples))]
    hi = ratios[min(resamples - 1, int((1 - tail) * resamples))]
    return lo, hi
