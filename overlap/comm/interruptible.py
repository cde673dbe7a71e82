"""Blocking waits that Ctrl-C can interrupt: a gloo collective's, and the rendezvous.

Python runs a signal's handler (Ctrl-C's KeyboardInterrupt) only between bytecodes of the
main thread, and ``Work.wait()`` blocks inside C++ until the op ends: a blocking
collective whose peer was late or stuck ignored Ctrl-C until the peer came or the job's
timeout (30 minutes by default) failed the op. Measured before this module: Ctrl-C one
second into a blocking ``all_reduce`` whose peer was asleep was raised 20.4 s later, when
the peer exited. torch's own blocking calls behave the same (pytorch/pytorch#63802 for its
rendezvous).

So on the main thread a gloo collective is waited for in slices: ``Work.wait(timeout)``
returns as soon as the op completes (no added latency: the same condition variable as the
untimed wait), and where the slice runs out it raises without touching the op (the base
``Work::wait``: measured on torch 2.13, an all_reduce, broadcast, all_gather and barrier
each gave the right result after nine 100 ms slices had run out). Between slices, Python
raises a pending KeyboardInterrupt. A slice that ran out is told from a failed op by
``is_completed()``, which a failed op sets and a running one does not, not by the
message; and an op that completed just after its slice ran out is waited for again
(untimed: it returns or raises its own outcome at once).

Not for point-to-point ops: a gloo send or receive whose timed wait runs out closes its
pair ("Application timeout caused pair closure", measured), and they are waited as before.
Not for NCCL either: there a timed ``wait`` blocks the host until the op ends, where the
untimed one only orders a stream. Other threads get no signals, and wait as before.

The rendezvous (``init_process_group`` waiting in torch's TCPStore for ranks that have not
come: a wrong WORLD_SIZE, a peer that failed to start) swallows Ctrl-C the same way until
the job's timeout (pytorch/pytorch#63802, open). :func:`rendezvous` runs it on a thread of
its own while the main thread waits in slices: Ctrl-C raises at once, and a rendezvous that
completes after it was abandoned is torn down again, so the process is left as it was.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["SLICE", "rendezvous", "wait"]

# Long enough that a slow op pays a few hundred slice ends at most (each about 20 us: a
# C++ exception turned into a Python one), short enough that Ctrl-C feels immediate.
SLICE = datetime.timedelta(milliseconds=200)
_SLICE_S = SLICE.total_seconds()
_MAIN = threading.main_thread().ident


def wait(work: Any, sliced: bool) -> None:
    """``work.wait()``; in slices where ``sliced`` (a gloo collective's Work) and this is
    the main thread, so that a KeyboardInterrupt is raised while the op still runs."""
    if not sliced or threading.get_ident() != _MAIN:
        work.wait()
        return
    while True:
        start = time.monotonic()
        try:
            work.wait(SLICE)
            return
        except RuntimeError:
            if work.is_completed() or time.monotonic() - start < _SLICE_S / 2:
                # it failed, or completed as the slice ran out; or this Work refused the
                # timed wait at once (no slice ran out): the untimed wait, its outcome
                work.wait()
                return


def rendezvous(start: Callable[[], None], stop: Callable[[], None]) -> None:
    """``start()`` (the blocking rendezvous); on the main thread, run on a thread of its own
    and waited for in slices, so that Ctrl-C raises here at once. Its error is raised here.
    If the wait is interrupted, the rendezvous is abandoned: it goes on waiting until its
    own timeout (torch cannot cancel it; the port stays taken until then), and ``stop()``
    undoes it if it completes after all, so the process is left uninitialised."""
    if threading.get_ident() != _MAIN:
        start()
        return
    lock = threading.Lock()
    outcome: list[BaseException | None] = []  # set once, by the thread, under the lock
    abandoned = False

    def body() -> None:
        try:
            start()
            got: BaseException | None = None
        except BaseException as exc:  # handed to the caller
            got = exc
        with lock:
            outcome.append(got)
            late = abandoned and got is None
        if late:
            log.info("init_distributed: the rendezvous completed after Ctrl-C; undone")
            stop()

    thread = threading.Thread(target=body, name="overlap-rendezvous", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(_SLICE_S)
    except BaseException:
        with lock:
            abandoned = True
            done = bool(outcome) and outcome[0] is None
        if done:  # it completed as the signal came: undo it here
            stop()
        raise
    if outcome[0] is not None:
        raise outcome[0]
