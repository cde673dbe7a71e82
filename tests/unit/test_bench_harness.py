"""The benchmarks' shared statistics: the bootstrap interval of a ratio of medians."""

from __future__ import annotations

import itertools
import math
import random
import statistics

from overlap.bench.harness import interval_cell, ratio_interval


def _noisy(n: int, seed: int) -> tuple[list[float], list[float]]:
    """Two methods timed round by round: a round's noise (a burst on a shared machine)
    slows both alike; b is 1.10x a at the same noise, plus a little of its own."""
    rng = random.Random(seed)
    a, b = [], []
    for _ in range(n):
        burst = rng.expovariate(1 / 30.0)  # shared by the round
        a.append(100.0 + burst + rng.gauss(0, 1))
        b.append(110.0 + 1.1 * burst + rng.gauss(0, 1))
    return a, b


def test_the_interval_holds_the_ratio_of_the_medians_and_is_repeatable() -> None:
    a, b = _noisy(301, 1)
    lo, hi = ratio_interval(b, a)
    point = statistics.median(b) / statistics.median(a)
    assert lo <= point <= hi and lo < hi
    assert (lo, hi) == ratio_interval(b, a)  # seeded: the same timings, the same interval
    assert lo > 1.0 and hi < 1.2, (lo, hi)


def test_pairing_by_round_narrows_the_interval_where_noise_is_shared() -> None:
    a, b = _noisy(400, 2)
    plo, phi = ratio_interval(b, a)  # equal lengths: paired by default
    ulo, uhi = ratio_interval(b, a, paired=False)
    assert phi - plo < (uhi - ulo) / 3, ((plo, phi), (ulo, uhi))
    assert plo <= 1.1 <= phi, (plo, phi)  # the true ratio at equal noise


def test_a_constant_ratio_has_no_width_and_too_few_samples_have_no_interval() -> None:
    a = [float(x) for x in range(1, 50)]
    lo, hi = ratio_interval([2 * x for x in a], a)
    assert math.isclose(lo, 2.0) and math.isclose(hi, 2.0)
    assert all(math.isnan(x) for x in ratio_interval([1.0], [1.0, 2.0]))
    assert interval_cell(ratio_interval([1.0], [1.0, 2.0])) == ""
    assert interval_cell([0.971, 1.064]) == "0.97-1.06" and interval_cell(None) == ""


def test_the_ops_bench_balances_which_method_runs_after_which() -> None:
    """Every k iterations put each method in each place once; every k! iterations hold each
    order once, so each method directly follows each other one equally often (a rotation
    alone kept the cyclic order: blocking always ran right after the reference)."""
    from collections import Counter

    from overlap.bench.ops import _rotated

    for methods in (["torch", "blocking", "wait", "await"], ["native", "blocking", "await"]):
        k = len(methods)
        orders = [tuple(_rotated(methods, i)) for i in range(math.factorial(k))]
        assert sorted(orders) == sorted(itertools.permutations(methods))
        for start in range(0, len(orders), k):
            for place in range(k):
                assert {o[place] for o in orders[start : start + k]} == set(methods)
        after = Counter((o[j], o[j + 1]) for o in orders for j in range(k - 1))
        assert len(after) == k * (k - 1) and len(set(after.values())) == 1
        assert _rotated(methods, math.factorial(k)) == methods  # then it starts again
    assert [_rotated(["a", "b"], i) for i in range(3)] == [["a", "b"], ["b", "a"], ["a", "b"]]
