"""Differential checks on random inputs: every op of overlap.comm against a reference each
rank computes itself, on 3 gloo ranks (tests/gloo/differential_cases.py; the same check
runs under mpiexec, tests/mpi), and the BucketScheduler against torch DDP on random
configurations, on 2 (tests/gloo/scheduler_differential_cases.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from overlap.testing import RankPool
from tests.gloo import differential_cases as dc
from tests.gloo import scheduler_differential_cases as sdc


@pytest.mark.parametrize("seed", [1, 2])
def test_random_ops_match_a_local_reference(pools: Callable[[int], RankPool], seed: int) -> None:
    out = pools(3).run(dc.run, seed, 200, timeout=120)
    assert out == [[], [], []], [b[:5] for b in out]


@pytest.mark.parametrize("seed", [1, 2])
def test_the_scheduler_on_random_configs_matches_ddp(
    pools: Callable[[int], RankPool], seed: int
) -> None:
    out = pools(2).run(sdc.run, seed, 10, timeout=120)
    assert out == [[], []], [b[:3] for b in out]
