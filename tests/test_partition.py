"""The exact min-max partitioner against brute force, and its tie-breaking."""

import itertools
import random

import pytest

from pt_ray.core.partition import partition

pytestmark = pytest.mark.unit


def brute_force(weights, k, first, last):
    n = len(weights)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        b = (0, *cuts, n)
        loads = [sum(weights[b[s]:b[s + 1]]) for s in range(k)]
        loads[0] += first
        loads[-1] += last
        best = min(best, max(loads))
    return best


def test_bottleneck_equals_brute_force_on_random_costs():
    rng = random.Random(1234)
    for _ in range(300):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        weights = [rng.choice([0.0, rng.uniform(0, 10)]) for _ in range(n)]
        first, last = rng.uniform(0, 8), rng.uniform(0, 3)
        p = partition(weights, k, first, last)
        assert p.bottleneck == pytest.approx(brute_force(weights, k, first, last), rel=1e-9)
        assert p.boundaries[0] == 0 and p.boundaries[-1] == n
        assert all(lo < hi for lo, hi in zip(p.boundaries, p.boundaries[1:]))


def test_optimum_on_small_literal_lists():
    # Five blocks in three stages: two stages must hold two blocks; the best is 4+4 | 4+4 | 2
    # or 4 | 4+4 | 4+2, both with bottleneck 8, and the balanced tie-break picks the second.
    p = partition([4, 4, 4, 4, 2], 3)
    assert p.bottleneck == 8
    assert p.loads == (4, 8, 6)
    assert partition([1, 1, 1, 1, 1, 1, 1, 1], 4).loads == (2, 2, 2, 2)


def test_extras_pull_blocks_away_from_first_and_last_stage():
    p = partition([1.0] * 6, 3, first_extra=2.0, last_extra=1.0)
    assert p.boundaries == (0, 1, 4, 6)
    assert p.loads == (3.0, 3.0, 3.0)


def test_balances_non_bottleneck_stages():
    # Bottleneck 10 is forced by the big block; the rest should be split evenly, not greedily.
    p = partition([10, 1, 1, 1, 1], 3)
    assert p.bottleneck == 10
    assert p.loads == (10, 2, 2)


def test_no_active_blocks_is_one_stage():
    p = partition([], 1, first_extra=3.0, last_extra=0.5)
    assert p.boundaries == (0, 0) and p.loads == (3.5,)


def test_bad_stage_count_is_named():
    with pytest.raises(ValueError, match="cannot split 3 blocks into 4"):
        partition([1, 1, 1], 4)
    with pytest.raises(ValueError, match=">= 0"):
        partition([1, -1], 1)
