"""The fault-injection layer, used once per tool on real gloo ranks (and under mpiexec for
the MPI backend), asserting docs/reliability.md's promises: a killed or stopped peer becomes
CommError within the job timeout + 5 s; a rank that fails before issuing an op leaves the
others waiting, not corrupted; a root-only bad argument leaves the group in step; a dropped
handle and a handle abandoned by a closed loop still finish."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from overlap.testing import RankPool
from tests.faults import scenarios as sc

JOB_TIMEOUT = 8


@pytest.mark.parametrize("action", ["kill", "stop"])
def test_a_peer_killed_or_stopped_at_an_op_is_comm_error_within_the_timeout(action: str) -> None:
    victim = 2
    with RankPool(3, timeout=JOB_TIMEOUT) as pool:
        res = pool.run(
            sc.peer_fails_at_op,
            action,
            victim,
            stop_s=JOB_TIMEOUT + 4,  # stopped past the timeout, then resumed
            timeout=60,
            expect_dead=[victim] if action == "kill" else [],
        )
    for r, got in enumerate(res):
        if r == victim:  # resumed after the others gave up: its op fails too, no hang
            assert action == "kill" or got["error"] in ("CommError", "CommTimeoutError"), got
            continue
        assert got["error"] in ("CommError", "CommTimeoutError"), (r, got)
        assert got["done"] == 3, (r, got)  # ops 1-3 finished; the 4th failed
        assert got["after_s"] < JOB_TIMEOUT + 5, (r, got)


def test_a_rank_that_fails_before_issuing_leaves_the_others_waiting_not_corrupted(
    pools: Callable[[int], RankPool],
) -> None:
    res = pools(3).run(sc.injected_raise_on_one_rank, timeout=60)
    assert [x["raised"] for x in res] == [True, False, False]
    assert [x["value"] for x in res] == [9.0, 9.0, 9.0]


@pytest.mark.parametrize("n", [2, 3])
def test_a_bad_argument_on_the_root_only_keeps_the_group_in_step(
    pools: Callable[[int], RankPool], n: int
) -> None:
    res = pools(n).run(sc.bad_argument_on_the_root_only, timeout=60)
    assert res[0]["error"] and "gather_list" in res[0]["error"]
    assert all(x["error"] is None for x in res[1:])
    assert all(x["next_ok"] for x in res)


def test_a_dropped_handle_still_finishes(pools: Callable[[int], RankPool]) -> None:
    assert pools(2).run(sc.dropped_handle_finishes, timeout=60) == [True, True]


def test_a_handle_abandoned_by_a_closed_loop_still_finishes(
    pools: Callable[[int], RankPool],
) -> None:
    res = pools(3).run(sc.loop_closed_under_an_await, timeout=60)
    assert res[0]["timed_out"]
    assert all(x["value"] == x["want"] for x in res)


def test_the_same_faults_under_mpiexec() -> None:
    from tests.mpi.conftest import MPIEXEC, mpiexec

    if MPIEXEC is None:
        pytest.skip("needs mpiexec")
    out = mpiexec(3, "-m", "tests.faults.mpi_run", timeout=120)
    results = [json.loads(x[7:]) for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert out.returncode == 0 and len(results) == 3, out.stdout[-2000:] + out.stderr[-2000:]
    by_rank = sorted(results, key=lambda d: d["rank"])
    assert [d["raise"]["raised"] for d in by_rank] == [True, False, False]
    assert [d["raise"]["value"] for d in by_rank] == [9.0] * 3
    assert by_rank[0]["bad_root"]["error"] and all(d["bad_root"]["next_ok"] for d in by_rank)
    assert all(d["closed_loop"]["value"] == d["closed_loop"]["want"] for d in by_rank)
    assert by_rank[0]["closed_loop"]["timed_out"]
