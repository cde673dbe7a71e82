"""DESIGN.md §3 contracts, each held by a test on real gloo ranks."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from overlap.testing import RankPool, spawn_ranks
from tests.conftest import LOOP_KINDS
from tests.gloo import contract_cases as cc


@pytest.mark.parametrize("loop", LOOP_KINDS)
def test_1000_handles_in_flight_gathered(pools: Callable[[int], RankPool], loop: str) -> None:
    # Also the same-order contract: issue order is program order on every rank, whatever
    # order the handles are awaited in.
    assert pools(2).run(cc.many_in_flight, 1000, loop, timeout=120) == [1000, 1000]


@pytest.mark.parametrize("loop", LOOP_KINDS)
def test_cancelled_awaiter_leaves_op_and_buffers(
    pools: Callable[[int], RankPool], loop: str
) -> None:
    assert pools(2).run(cc.cancelled_awaiter, loop, timeout=60) == [[1.0, 2.0, 3.0]] * 2


def test_timeouts_are_taken_at_the_awaiting_side(pools: Callable[[int], RankPool]) -> None:
    assert pools(2).run(cc.timeout_at_awaiting_side, timeout=60) == [[5.0, 6.0]] * 2


def test_handle_keeps_its_tensors_until_complete(pools: Callable[[int], RankPool]) -> None:
    assert pools(2).run(cc.handle_keeps_tensors, timeout=60) == [True, True]


def test_nothing_blocks_in_future_callbacks(pools: Callable[[int], RankPool]) -> None:
    assert pools(2).run(cc.callbacks_never_block, timeout=90) == [50, 50]


def test_a_raising_callback_harms_no_other_callback_or_op(
    pools: Callable[[int], RankPool],
) -> None:
    cc.check_raising_callbacks(pools(2).run(cc.a_raising_callback_harms_nothing, timeout=60))


def test_event_loops_that_awaited_ops_are_freed(pools: Callable[[int], RankPool]) -> None:
    # 0.1.0 to the forty-eighth session: every loop was kept with its eventfd, (30, 30)
    assert pools(2).run(cc.loops_are_freed, 30, timeout=60) == [(0, 0), (0, 0)]


def test_futureless_ops_complete_through_waiter_threads(
    pools: Callable[[int], RankPool],
) -> None:
    assert pools(3).run(cc.futureless_ops_use_waiter_threads, timeout=60) == [True] * 3


def test_peer_that_never_sends_times_out_and_process_shuts_down() -> None:
    t0 = time.monotonic()
    waited = spawn_ranks(cc.peer_never_sends, 2, "uvloop", timeout=90)
    assert 0.45 < waited[0] < 5
    assert time.monotonic() - t0 < 60  # start, time out, destroy the group, exit


def test_awaiting_a_failed_op_raises_comm_error_with_cause() -> None:
    with RankPool(2, timeout=90) as pool:
        res = pool.run(cc.peer_dies_mid_op, timeout=90)
    kind, cause, msg, seconds = res[0]
    assert kind == "CommError" and "irecv on rank 0" in msg
    assert cause not in ("NoneType", "")  # the backend's error is kept as __cause__
    assert seconds < 30
    assert res[1] == "exiting"


def test_dropped_handle_still_completes_and_is_freed(pools: Callable[[int], RankPool]) -> None:
    assert pools(2).run(cc.dropped_handle_still_completes, timeout=60) == [[1.0, 2.0, 3.0]] * 2


def test_awaited_ops_spin_on_an_idle_loop(pools: Callable[[int], RankPool]) -> None:
    assert pools(2).run(cc.awaited_ops_spin_on_an_idle_loop, timeout=60)[0] == [True] * 5


def test_blocking_ops_poll_only_what_a_window_can_see_complete(
    pools: Callable[[int], RankPool],
) -> None:
    small, large = pools(2).run(cc.blocking_ops_poll_only_what_a_window_can_see_complete)[0]
    assert small > 0.02, small  # the poll ran (it yields, so it is not all CPU)
    assert large < small / 2 and large < 0.05, (small, large)


def test_collect_all_spins_share_one_window(pools: Callable[[int], RankPool]) -> None:
    held = pools(2).run(cc.collect_all_spins_share_one_window, timeout=60)
    assert 0.0 < held[0] < 0.2


def test_run_awaits_a_handle_or_a_collect_all(pools: Callable[[int], RankPool]) -> None:
    out = pools(2).run(cc.run_takes_handles, timeout=60)
    assert out == [[[3.0] * 3, [3.0] * 3], [[3.0] * 3, [3.0] * 3]], out


@pytest.mark.parametrize("big_send", [False, True], ids=["small", "send_past_the_window"])
def test_collect_all_hands_off_its_p2p_ops_together(
    pools: Callable[[int], RankPool], big_send: bool
) -> None:
    got = pools(2).run(cc.collect_all_hands_off_together, big_send, timeout=60)
    send_done, recv_done = got[0]
    assert send_done < 0.15, f"the send completed {send_done:.3f} s after its post"
    assert recv_done > 0.4


@pytest.mark.parametrize("blocking", [False, True], ids=["isend_irecv", "send_recv"])
def test_p2p_calls_seen_before_check_what_can_change(
    pools: Callable[[int], RankPool], blocking: bool
) -> None:
    assert pools(2).run(cc.p2p_last_call, blocking, timeout=90) == ["ok", "ok"]
