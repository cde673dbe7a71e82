"""Multi-phase reductions written once, run blocking or awaited.

A compressed reduction has phases: issue some collectives, wait for them, compute, issue
more. Each such algorithm is written as a generator that *yields* the list of handles it
needs finished before its next phase and *returns* its result::

    def steps(...) -> Steps:
        hs = [comm.all_to_all_single(..., async_op=True), ...]
        yield hs            # the driver finishes these
        ...                 # compute on their results
        return result

:func:`run` drives it on the calling thread (``h.wait()``), :func:`run_async` drives it on an
event loop (``await``), and :func:`steps_handle` wraps it in a
:class:`~overlap.comm.handle.Handle` that does either, whichever is asked for first. The
same code runs in every mode, so blocking and awaited results cannot diverge.

Ordering (DESIGN.md contract 1): the first phase is issued when the generator is started, on
the caller's thread. Later phases are issued by whoever drives the handle, when it is waited
or awaited: a program that waits its handles in the same order on every rank issues them in
the same order on every rank.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Generator
from typing import Any

from overlap.comm.collect import collect_all
from overlap.comm.handle import Handle, HandleState
from overlap.errors import CommTimeoutError, NonFiniteError

__all__ = ["Steps", "in_step", "run", "run_async", "steps_handle"]

Steps = Generator[list[Handle], None, Any]


def in_step(exc: BaseException) -> bool:
    """True for an error of a steps generator that leaves the ranks' collectives paired: a
    NonFiniteError, which every rank raises after the same phase (the Compressor contract).
    Any other error (this rank's own, or a failed collective) may leave this rank's issued
    collectives short of its peers', so whoever runs several such generators in a fixed
    order on one group (the scheduler's launcher, a group's driver) must issue no more."""
    return isinstance(exc, NonFiniteError)


def run(steps: Steps) -> Any:
    """Drive ``steps`` to the end on this thread; return its result.

    A handle that fails is thrown into the generator at its ``yield``, so the algorithm can
    clean up (or recover and yield again); uncaught, the error propagates from here."""
    try:
        pending = next(steps)
        while True:
            try:
                for h in pending:
                    h.wait()
            except BaseException as exc:
                pending = steps.throw(exc)
                continue
            pending = steps.send(None)
    except StopIteration as stop:
        return stop.value


async def run_async(steps: Steps) -> Any:
    """Drive ``steps`` to the end on the running loop; return its result (errors are
    thrown into the generator as in :func:`run`)."""
    try:
        pending = next(steps)
        while True:
            try:
                await collect_all(pending)
            except BaseException as exc:
                pending = steps.throw(exc)
                continue
            pending = steps.send(None)
    except StopIteration as stop:
        return stop.value


class _StepsOp:
    """Completion engine of a steps handle: the first to wait or await drives the generator."""

    def __init__(self, steps: Steps, pending: list[Handle]) -> None:
        self.steps = steps
        self.pending = pending
        self.lock = threading.Lock()
        self.driver: str | None = None  # "thread" or "loop"
        self.task: asyncio.Task[None] | None = None

    def _advance(self, handle: Handle, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                phase = collect_all(self.pending)
                try:
                    phase.wait(left)
                except CommTimeoutError:
                    if phase.state is HandleState.PENDING:
                        return False  # resumable: the next wait continues where this stopped
                    # An op of the phase failed with CommTimeoutError (MPI's job timeout):
                    # the steps handle fails with it. Before, that error was taken for this
                    # wait's own timeout: the handle stayed pending for good, and every
                    # wait() said it "did not complete within None s".
                    raise
                self.pending = self.steps.send(None)
        except StopIteration as stop:
            handle._result = stop.value
            handle._finish(None)
        except BaseException as exc:
            handle._finish(exc)
        return True

    def start(self, handle: Handle) -> None:
        loop = asyncio._get_running_loop()
        if loop is not None:
            self.on_await(handle, loop)

    def wait(self, handle: Handle, timeout: float | None) -> bool:
        with self.lock:
            mine = self.driver in (None, "thread")
            if mine:
                self.driver = "thread"
                if handle.done():
                    return True
                return self._advance(handle, timeout)
        return handle._block_until_done(timeout)

    def on_await(self, handle: Handle, loop: asyncio.AbstractEventLoop) -> None:
        with self.lock:
            if self.driver is not None:
                return
            self.driver = "loop"
        self.task = loop.create_task(self._drive(handle))

    async def _drive(self, handle: Handle) -> None:
        try:
            while True:
                await collect_all(self.pending)
                self.pending = self.steps.send(None)
        except StopIteration as stop:
            handle._result = stop.value
            handle._finish(None)
        except BaseException as exc:
            handle._finish(exc)


def steps_handle(
    op: str, steps: Steps, *, nbytes: int = 0, group: str = "world", backend: str = ""
) -> Handle:
    """Start ``steps`` (its first phase is issued now) and return a Handle for the rest."""
    handle = Handle(op, result=None, nbytes=nbytes, group=group, backend=backend)
    try:
        pending = next(steps)
    except StopIteration as stop:
        handle._result = stop.value
        handle._finish(None)
        return handle
    handle._engine = _StepsOp(steps, pending)
    return handle
