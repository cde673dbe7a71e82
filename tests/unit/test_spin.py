"""overlap.comm.spin: the ops of one collect_all share one spin window."""

from __future__ import annotations

import threading
import time

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
