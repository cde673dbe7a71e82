"""The deepspeed.comm names overlap.comm added, on real gloo ranks (2 and 3): every check of
tests/gloo/ds_comm_cases.py in one pass per world size, reported per check."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from overlap.testing import RankPool
from tests.gloo import ds_comm_cases as ds

_runs: dict[int, list[dict[str, str]]] = {}


def _results(pools: Callable[[int], RankPool], n: int) -> list[dict[str, str]]:
    if n not in _runs:
        _runs[n] = pools(n).run(ds.run_all, timeout=180)
    return _runs[n]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("check", list(ds.CHECKS))
def test_ds_comm_op(pools: Callable[[int], RankPool], n: int, check: str) -> None:
    for rank, res in enumerate(_results(pools, n)):
        assert res[check] == "ok", f"rank {rank}:\n{res[check]}"


def test_monitored_barrier_names_the_rank_that_did_not_arrive() -> None:
    # its own ranks: after a failed monitored_barrier the receives of the release stay
    # posted, and gloo closes the pair when they reach the job timeout (docs/api.md), so the
    # shared pools are not used
    with RankPool(3, timeout=60) as pool:
        pool.run(ds.monitored_barrier_names_the_late_rank, timeout=60)
