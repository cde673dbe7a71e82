"""Let backend threads finish with Python before the interpreter finalizes.

A torch op observed off the main thread ends in Python code run by a thread that is inside
C++: gloo's own worker thread runs a future's done-callback (and then drops the callback,
which takes the GIL again), a waiter thread returns from ``Work.wait()``. Once interpreter
finalization has begun, a thread that takes the GIL is ended with ``pthread_exit``; unwinding
that through torch's C++ frames calls ``std::terminate``, and the process aborts (exit code
-6, "terminate called after throwing an instance of 'gloo::IoException'"). Measured: the
survivor of a peer's SIGKILL aborted this way at exit in 2 of 20 runs, when a bucket
reduction still queued on gloo's thread failed during finalization; and a rank that timed
out waiting on an awaited all_reduce and then exited aborted when its peer left.

So every asynchronous observation of a torch op is registered here from before it can start
until its last line of Python has run, and an ``atexit`` hook (atexit runs before
finalization, while threads can still take the GIL) waits until none is left, for at most
the job's timeout + 5 s (after that every gloo op has failed by its own timeout). This moves
no wait earlier than torch itself makes it: the process group's destructor already waits at
exit for every op still queued (measured: a rank exiting with an unmatched all_reduce
stayed until its peer left). A short grace after the last observation ends covers the C++
code that still holds the GIL after our callback returns.

Point-to-point ops and MPI ops are not registered (see :func:`begin`; mpi4py calls no
Python from MPI's threads).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = [
    "begin",
    "drain",
    "end",
    "install",
    "outstanding",
    "release_at_exit",
    "tearing_down",
]

log = logging.getLogger(__name__)

GRACE_S = 0.02  # after the last observation ends: torch drops the callback under the GIL
WARN_AFTER_S = 2.0  # say what the exit waits for once it has waited this long

_observing: dict[int, Any] = {}  # dict operations are atomic under the GIL: no lock
_last_end = 0.0
_installed = False
_install_lock = threading.Lock()
_timeout_s = 1800.0  # the job's op timeout (install); torch's default until then
_release: Callable[[], None] | None = None  # the job's teardown at exit (release_at_exit)
_tearing_down = False  # set as that teardown starts (tearing_down)


_P2P = frozenset({"isend", "irecv"})


def begin(handle: Any) -> None:
    """An asynchronous observation of ``handle``'s op starts (idempotent).

    Point-to-point ops are left out: torch does not hold the exit for them (they are not
    queued on the group's worker), and an unmatched receive would hold it for the whole job
    timeout (measured before this hook: a rank with an unmatched irecv exited in 0.4 s)."""
    if handle.op not in _P2P:
        _observing[id(handle)] = handle


def end(handle: Any) -> None:
    """The observation's last Python line has run (call from a ``finally``)."""
    global _last_end
    if _observing.pop(id(handle), None) is not None:  # a p2p op was never registered
        _last_end = time.monotonic()


def outstanding() -> int:
    """How many observations have not ended."""
    return len(_observing)


def drain(timeout: float) -> int:
    """Wait until every observation has ended, or ``timeout`` seconds pass. Returns how
    many are left. Releases the GIL while it waits."""
    start = time.monotonic()
    deadline = start + timeout
    warned = False
    pause = 0.001
    while _observing:
        now = time.monotonic()
        if now >= deadline:
            break
        if not warned and now - start >= WARN_AFTER_S:
            warned = True
            log.warning(
                "exit waits for %d op(s) still in flight (%s); they end when their peers "
                "complete them, leave, or the job timeout passes",
                len(_observing),
                ", ".join(repr(h) for h in list(_observing.values())[:3]),
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    since = time.monotonic() - _last_end
    if since < GRACE_S:
        time.sleep(GRACE_S - since)
    left = len(_observing)
    if left:
        log.warning("exit gave up waiting for %d op(s) still in flight", left)
    return left


def release_at_exit(fn: Callable[[], None] | None) -> None:
    """``fn`` runs at exit once every observation has ended (none left): how
    :func:`~overlap.comm.init.init_distributed` has a job it made torn down before the
    interpreter finalizes; None takes it back (the job was destroyed).

    Why (fifty-eighth session): a gloo op that failed by its timeout while its peer lived
    (the peer never called it), caught by the caller, whose Work was then freed, made the
    process abort at its exit ("terminate called without an active exception", exit 134)
    when it exited within about half a second of the failure; torch alone does the same
    (a ``Work`` dropped in a function, then exit). ``destroy_process_group()`` before the
    interpreter finalizes exits 0, and takes no longer: the group's destructor waits for
    queued collectives at exit either way."""
    global _release
    _release = fn


def tearing_down() -> bool:
    """True once the exit hook tears the job down (:func:`release_at_exit`): an error a
    background thread meets from then on (a scheduler's bucket still queued when the program
    ended, finding the job gone) is the exit's doing, not a fault to report."""
    return _tearing_down


def _at_exit() -> None:
    try:
        left = drain(_timeout_s + 5.0)
        if left == 0 and _release is not None:
            global _tearing_down
            _tearing_down = True
            try:
                _release()
            except Exception as exc:  # at exit: say it, the process still exits
                log.warning("exit could not destroy the process group: %s", exc)
    except KeyboardInterrupt:  # a second Ctrl-C at exit: stop waiting, say what may follow
        log.warning(
            "exit stopped waiting for %d op(s) in flight; if one fails during interpreter "
            "shutdown the process aborts (terminate called)",
            len(_observing),
        )


def install(timeout_s: float | None) -> None:
    """Register the exit hook once per process; ``timeout_s`` is the job's op timeout
    (``None``: torch's default of 30 minutes)."""
    global _installed, _timeout_s
    _timeout_s = 1800.0 if timeout_s is None else float(timeout_s)
    with _install_lock:
        if not _installed:
            _installed = True
            atexit.register(_at_exit)
