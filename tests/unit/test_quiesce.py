"""overlap.comm.quiesce: exit waits for observations of collectives, not of p2p ops."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from overlap.comm import quiesce


def _op(name: str) -> SimpleNamespace:
    return SimpleNamespace(op=name)


def test_drain_waits_until_the_last_observation_ends() -> None:
    h = _op("all_reduce")
    quiesce.begin(h)
    quiesce.begin(h)  # idempotent
    assert quiesce.outstanding() == 1
    threading.Timer(0.2, quiesce.end, (h,)).start()
    t0 = time.monotonic()
    assert quiesce.drain(10.0) == 0
    waited = time.monotonic() - t0
    assert 0.15 < waited < 5.0, waited
    assert quiesce.outstanding() == 0


def test_drain_gives_up_after_its_timeout_and_says_how_many_are_left() -> None:
    h = _op("broadcast")
    quiesce.begin(h)
    try:
        t0 = time.monotonic()
        assert quiesce.drain(0.1) == 1
        assert time.monotonic() - t0 < 2.0
    finally:
        quiesce.end(h)
    assert quiesce.drain(0.1) == 0


def test_point_to_point_ops_are_not_waited_for() -> None:
    for name in ("isend", "irecv"):
        quiesce.begin(_op(name))
    assert quiesce.outstanding() == 0
