"""``collect_all``: one Handle for several in-flight ops, awaited without a task per op.

``await asyncio.gather(*handles)`` wraps every handle in a Task and wakes the loop once per
handle. On this project's machine that costs about 10 us for two handles that are already
done (uvloop), as much as an 8-byte MPI sendrecv itself: an awaited sendrecv as gather took
2.5x mpi4py's Irecv + Isend + Waitall, awaiting the two handles one after the other 1.2-1.3x
(docs/benchmarks.md). ``await comm.collect_all(handles)`` lets each backend observe its
handles as a lone ``await`` would (a short spin on the loop's thread, then MPI's progress
engine, gloo's future callback or a waiter thread; the spins of one collect_all share one
window, overlap.comm.spin) and wakes the awaiting coroutine once, when the last one completes.

Contract, as for any Handle and as ``asyncio.gather``'s default:

* the result is the list of the handles' results, in order (gather's; torch's
  ``torch.futures.collect_all`` returns the futures instead);
* it fails as soon as any handle fails, with that handle's own exception; the other ops run
  on, keep their tensors, and can still be awaited or waited on one by one;
* a timeout or a cancellation ends the wait, never the ops (``h.wait(timeout)``,
  ``asyncio.wait_for``);
* ``h.wait()`` waits for the handles in order, each the way its own ``wait()`` would (on the
  calling thread, no hand-off);
* the combined handle is not traced: each op in it reports itself, so a tracer sees every op
  once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Generator, Iterable
from typing import Any

from overlap.comm import spin as _spin
from overlap.comm.handle import _LOCK, FAILED, OWN_ENGINE, PENDING, Handle, turn_due
from overlap.comm.progress import spin_together
from overlap.comm.waiters import start_together

__all__ = ["collect_all"]


class _Collected(Handle):
    """A Handle that stands for other handles, and is its own completion engine (through
    :data:`~overlap.comm.handle.OWN_ENGINE`), as an MpiOp is: one object per
    ``collect_all``. Not reported to the tracer (its ops are).

    Made with a separate engine object (the handles, a countdown), an awaited
    ``collect_all`` of two handles that were already done cost 5.0 us (single process,
    uvloop; 3.7-3.9 now) against 0.5 for awaiting the two one after the other, and an
    awaited 8-byte MPI sendrecv 30.8 us against 18.6 (2 ranks): the time between the
    receive's completion and the next post is on both ranks' critical path
    (docs/architecture.md, "The awaited op's own path")."""

    __slots__ = ("_left", "_watching", "handles")
    _observed = False

    def __init__(self, hs: list[Handle], nbytes: int, group: str, backend: str, world: int):
        Handle.__init__(self, "collect_all", None, nbytes, group, backend, None, OWN_ENGINE, world)
        self.handles = hs
        self._left = len(hs)  # handles not yet counted as done (see _watch)
        self._watching = False

    def __await__(self) -> Generator[Any, None, Any]:
        """:meth:`Handle.__await__`, with MPI's common case first: ops that are all the MPI
        ops open in the process are tested in a tight loop before any loop is looked up
        (:func:`overlap.comm.progress.spin_together`)."""
        if self._state is PENDING:
            spun = spin_together(self.handles)
            if spun:
                self._settle()
            else:
                loop = asyncio.get_running_loop()
                self._on_await(loop, spun is False)  # False: the window is spent
                if self._state is PENDING:
                    yield from self._suspend(loop)
                    return self.result()
        if turn_due():
            yield  # the loop's turn (overlap.comm.handle.turn_due)
        return self.result()

    def _settle(self) -> bool:
        """Finish if a handle failed or none is pending; True once it is over."""
        pending = False
        for h in self.handles:
            state = h._state
            if state is FAILED:
                self._finish(h._exc)
                return True
            if state is PENDING:
                pending = True
        if pending:
            return False
        if self._state is PENDING:
            self._result = self._results()
        self._finish(None)
        return True

    def _results(self) -> Any:
        """The result once every handle is done: their results, in order."""
        return [h._result for h in self.handles]

    def _one_done(self, h: Handle) -> None:
        # Any thread (a backend's, a waiter's, the loop's): a few stores under a short lock.
        if h._state is FAILED:
            self._finish(h._exc)
            return
        with _LOCK:
            self._left -= 1
            last = self._left == 0
        if last:
            self._settle()

    def _watch(self) -> None:
        """Count the handles down as they complete (once; O(1) per completion)."""
        with _LOCK:
            if self._watching:
                return
            self._watching = True
        done = self._one_done
        for h in self.handles:
            if not h._subscribe(done):
                done(h)

    def _start(self) -> None:
        self._watch()
        for h in self.handles:
            if h._state is PENDING:
                h._engine.start(h)

    def _wait(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        for h in self.handles:
            if h._state is PENDING:
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                if not h._engine.wait(h, left):
                    return False
            if h._state is FAILED:
                break
        self._settle()
        return True

    def _on_await(self, loop: asyncio.AbstractEventLoop, spent: bool = False) -> None:
        # The handles' spins share one window (overlap.comm.spin): a collect_all of many
        # small ops must not hold the loop for all of them in this one callback. ``spent``:
        # the await has used the window already (spin_together), so none spins again.
        outer = _spin.shared()
        if spent:
            _spin.expire()
        try:
            if not spent:
                start_together(self.handles)
            for h in self.handles:
                if h._state is PENDING:
                    h._engine.on_await(h, loop)
        finally:
            _spin.end_shared(outer)
        if not self._settle():
            self._watch()


def collect_all(handles: Iterable[Handle]) -> Handle:
    """One Handle that completes when every handle in ``handles`` has; its result is the list
    of their results, in order. Awaiting it costs one wake-up, where ``asyncio.gather`` makes a
    Task per handle (module docstring: the contract and the figures).

    ``handles`` is a list (or any iterable) of the Handles that ``async_op=True`` calls,
    ``isend``, ``irecv`` and ``batch_isend_irecv`` return; an empty one gives a handle that is
    already done with ``[]``. Its ``group`` and ``backend`` are the handles' own, or
    ``"mixed"`` where they differ.
    """
    if isinstance(handles, Handle):
        raise TypeError(
            "collect_all() takes a list of Handles, not one Handle: "
            "collect_all([h1, h2]); await a single Handle directly"
        )
    hs = list(handles)
    if not hs:
        done = _Collected([], 0, "world", "", 1)
        done._settle()  # nothing pending: done, with []
        return done
    first = hs[0]
    group, backend, nbytes, world = first.group, first.backend, 0, 1
    for h in hs:  # one pass: this is on the path of every awaited batch
        if not isinstance(h, Handle):
            i = next(i for i, x in enumerate(hs) if x is h)
            raise TypeError(
                f"collect_all() takes overlap Handles; item {i} is {type(h).__name__}: pass "
                "what async_op=True calls, isend, irecv and batch_isend_irecv return"
            )
        nbytes += h.nbytes
        if h.world > world:
            world = h.world
        if h.group != group:
            group = "mixed"
        if h.backend != backend:
            backend = "mixed"
    return _Collected(hs, nbytes, group, backend, world)
