"""The benchmarks' own helpers (benchmarks/): the statistics their tables print and the cost model's check."""

from __future__ import annotations

import numpy as np


def test_median_interval_is_the_sign_test_interval_and_covers():
    """benchmarks.common.median_interval: the order statistics of the sign test (n = 9 at 90%: the 2nd and 8th
    of the sorted values, which cover the median with probability 1 - 2 x 10/512 = 0.961), None when too few
    passes, and the coverage it promises on skewed draws."""
    from benchmarks.common import median_interval

    assert median_interval([5, 1, 4, 2, 3]) == (1.0, 5.0)
    assert median_interval([9, 1, 8, 2, 7, 3, 6, 4, 5]) == (2.0, 8.0)
    assert median_interval([1, 2, 3, 4]) is None
    rng = np.random.default_rng(0)
    draws = rng.lognormal(size=(4000, 9))  # skewed: the true median is exp(0) = 1
    covered = np.mean([lo <= 1.0 <= hi for lo, hi in map(median_interval, draws)])
    assert 0.95 < covered < 0.975, covered
