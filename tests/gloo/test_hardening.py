"""Hardening (issue #19): each scenario with real gloo processes, asserting the fixed behaviour."""

from __future__ import annotations

from collections.abc import Callable

from overlap.testing import RankPool, spawn_ranks
from tests.gloo import hardening_cases as hc


def test_any_number_of_outstanding_receives(pools: Callable[[int], RankPool]) -> None:
    n = 40  # the old waiter pool capped at 32 threads and deadlocked here
    res = pools(2).run(hc.many_outstanding_receives, n, timeout=120)
    assert res[0] == [10.0 * i for i in range(n)]


def test_destroy_fails_pending_handles() -> None:
    res = spawn_ranks(hc.destroy_fails_pending_handles, 2, timeout=60)
    assert res[0] == ["awaited: CommError", "untouched: CommError"]


def test_new_group_inherits_the_job_timeout() -> None:
    res = spawn_ranks(hc.new_group_inherits_timeout, 2, timeout=60)
    kind, seconds = res[0]
    assert kind == "CommError", res
    assert seconds < 7.5, res  # the peer came 8 s late: the 3 s job timeout applied


def test_requires_grad_leaf(pools: Callable[[int], RankPool]) -> None:
    for r, out in enumerate(pools(2).run(hc.requires_grad_leaf_ops, timeout=60)):
        assert out["avg"] == [out["expect_avg"]] * 3
        assert out["same_object"]
        assert out["reduce"] == ([3.0, 3.0] if r == 0 else [float(r + 1)] * 2)
        assert out["async_avg"] == [1.0, 1.0]


def test_last_skipped_covers_every_bucket(pools: Callable[[int], RankPool]) -> None:
    assert pools(2).run(hc.skip_flag_covers_every_bucket, timeout=120) == [[True, False]] * 2


def test_spawn_ranks_env_enables_debug_mode() -> None:
    assert spawn_ranks(hc.debug_enabled, 1, env={"OVERLAP_DEBUG": "1"}, timeout=60) == [True]
