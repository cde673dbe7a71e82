"""overlap.comm.spin: the ops of one collect_all share one spin window."""

from __future__ import annotations

import threading
import time

import pytest

from overlap.comm import spin


def test_outside_a_shared_window_each_op_gets_its_own() -> None:
    assert spin.window(0.5) == 0.5
    assert spin.window(0.5) == 0.5


def test_inside_one_the_first_op_opens_it_and_the_rest_get_what_is_left() -> None:
    outer = spin.shared()
    try:
        assert spin.window(0.05) == 0.05
        time.sleep(0.03)
        left = spin.window(0.05)
        assert 0.0 < left <= 0.021, left
        time.sleep(0.03)
        assert spin.window(0.05) == 0.0
        inner = spin.shared()  # a collect_all inside a collect_all: the outer window goes on
        try:
            assert spin.window(0.05) == 0.0
        finally:
            spin.end_shared(inner)
        assert spin.window(0.05) == 0.0
    finally:
        spin.end_shared(outer)
    assert outer is None and spin.window(0.05) == 0.05


def test_another_thread_does_not_share_this_threads_window() -> None:
    seen: list[float] = []
    outer = spin.shared()
    try:
        spin.window(0.05)
        time.sleep(0.06)
        t = threading.Thread(target=lambda: seen.append(spin.window(0.05)))
        t.start()
        t.join()
    finally:
        spin.end_shared(outer)
    assert seen == [0.05]


class _Done:
    """Stands in for a gloo Work's ``is_completed()``: done after ``after`` polls."""

    def __init__(self, after: int) -> None:
        self.after, self.polls = after, 0

    def is_completed(self) -> bool:
        self.polls += 1
        return self.polls > self.after


def test_a_blocking_wait_polls_first_on_a_users_thread_only_when_nothing_is_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from overlap.comm import claims, inflight, waiters

    # A user's thread, nothing in flight: polled until done. With the default 300 us window
    # a loaded CI machine ran the window out after 2 polls (the thread yields between
    # polls): a second's window keeps the check about the stop, not about the clock.
    monkeypatch.setattr(waiters, "SPIN_S", 1.0)
    work = _Done(after=3)
    waiters.poll_first(work)
    assert work.polls == 4
    monkeypatch.undo()

    work = _Done(after=10**9)  # never done: the poll ends at the window (300 us)
    t0 = time.perf_counter()
    waiters.poll_first(work)
    assert work.polls >= 1 and time.perf_counter() - t0 < 0.25

    busy = object()
    inflight.track(busy)  # another op observed asynchronously: its threads need the cores
    try:
        work = _Done(after=0)
        waiters.poll_first(work)
        assert work.polls == 0
    finally:
        inflight.untrack(busy)

    seen: list[int] = []

    def overlaps_own_thread() -> None:  # a bucket worker, a steps driver
        claims.internal_thread()
        w = _Done(after=0)
        waiters.poll_first(w)
        seen.append(w.polls)

    t = threading.Thread(target=overlaps_own_thread)
    t.start()
    t.join()
    assert seen == [0]
