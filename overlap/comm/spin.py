"""One spin window for the ops awaited together.

Both completion paths wait for an op awaited on an idle loop on the loop's own thread for a
short window before handing it off (gloo: ``OVERLAP_GLOO_SPIN_US``, overlap.comm.waiters;
MPI: ``OVERLAP_MPI_SPIN_US``, overlap.comm.progress), so a small op completes with no
wake-up. Each window is bounded, so one await never holds the loop longer than a short
callback. ``collect_all`` observes its handles one after another inside one callback, and
the op it spins on first finishes the spin, leaving the loop idle for the next: without a
shared bound, a collect_all of N small ops that complete one after another spun through all
of them in one callback (measured before this module, with a 50 ms window: 20 all_reduces
whose peer issued them 20 ms apart held the loop 0.39 s, on gloo and on MPI alike). Inside
:func:`shared` every op's window ends no later than the first one's.

Per thread: an event loop runs on one thread, and two loops on two threads do not share.
"""

from __future__ import annotations

import threading
import time

__all__ = ["end_shared", "expire", "shared", "window"]


class _Window(threading.local):
    # A class attribute, so reading it never raises: getattr(local, name, None) on a
    # thread-local with no such attribute costs 0.4 us, this 0.06 (every awaited op reads it).
    until: float | None = None  # None: no shared window; _OPEN: shared, not yet started


_local = _Window()
_OPEN = -1.0


def window(seconds: float) -> float:
    """How long the op being awaited may spin: ``seconds``, or less inside :func:`shared`
    once an earlier op of the same await has used part of the shared window (never < 0)."""
    until = _local.until
    if until is None:
        return seconds
    now = time.perf_counter()
    if until == _OPEN:
        _local.until = now + seconds
        return seconds
    return max(0.0, min(seconds, until - now))


def shared() -> float | None:
    """Begin a shared window (pass the result to :func:`end_shared`, in a ``finally``)."""
    outer = _local.until
    if outer is None:
        _local.until = _OPEN
    return outer  # nested: the outer window goes on


def expire() -> None:
    """Inside :func:`shared`: end the window now, so the ops observed after this do not spin
    (their await has spun through its window already)."""
    _local.until = 0.0


def end_shared(outer: float | None) -> None:
    _local.until = outer
