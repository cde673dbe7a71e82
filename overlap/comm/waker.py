"""Deliver completions from any thread to an asyncio event loop, cheaply.

Why not ``loop.call_soon_threadsafe``? On uvloop it wakes the loop while the calling thread
still holds the GIL, so the woken loop thread immediately blocks on the GIL again: two wake-ups
per completion. Writing to an eventfd (a pipe off Linux) with ``os.write`` releases the GIL
around the system call, so the loop thread wakes and runs at once. Measured on this project's
2-core machine: 4-byte gloo all_reduce awaited through a gloo future callback +
call_soon_threadsafe took 1.43x the blocking call, the waiter thread + eventfd path 1.22x.

A waker is created on the loop's own thread (``add_reader`` is not thread-safe) and lives as
long as the loop object; its file descriptors are closed when the loop is collected. The
registry maps each loop to its waker weakly, and the waker holds no reference to its loop:
before, it did, so the registry's entry kept every loop that ever awaited a gloo op alive,
with its eventfd open. Measured on 2 gloo ranks, 100 ``overlap.run`` calls that each awaited
one all_reduce (a loop per call, as a training loop that runs each step that way): 53 loops
and 53 eventfds more alive after than before, on rank 0 (the others had completed in the
spin, with no waker); with the peer 3 ms late, 30 calls kept 30 of each, under mpiexec too.
"""

from __future__ import annotations

import asyncio
import collections
import os
import threading
import weakref
from typing import Any

__all__ = ["LoopWaker", "resolve"]

_registry: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopWaker] = (
    weakref.WeakKeyDictionary()
)
_registry_lock = threading.Lock()


def _close_fds(fds: tuple[int, ...]) -> None:
    for fd in set(fds):
        try:
            os.close(fd)
        except OSError:
            pass


class LoopWaker:
    """A self-pipe for one event loop: ``post(fut)`` from any thread resolves ``fut`` on it."""

    __slots__ = ("__weakref__", "_pending", "_rfd", "_wfd")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        if hasattr(os, "eventfd"):
            fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self._rfd, self._wfd = fd, fd
        else:  # pragma: no cover - non-Linux
            self._rfd, self._wfd = os.pipe()
            os.set_blocking(self._rfd, False)
            os.set_blocking(self._wfd, False)
        # no reference to the loop here (see the module's docstring)
        self._pending: collections.deque[asyncio.Future[Any]] = collections.deque()
        loop.add_reader(self._rfd, self._drain)
        weakref.finalize(loop, _close_fds, (self._rfd, self._wfd))

    @classmethod
    def for_loop(cls, loop: asyncio.AbstractEventLoop) -> LoopWaker:
        """The waker of ``loop``; call it on the loop's thread (it may add a reader)."""
        waker = _registry.get(loop)
        if waker is None:
            with _registry_lock:
                waker = _registry.get(loop)
                if waker is None:
                    waker = cls(loop)
                    _registry[loop] = waker
        return waker

    def post(self, fut: asyncio.Future[Any]) -> None:
        """Resolve ``fut`` (with None) on the loop thread. Safe from any thread; never blocks.
        A future already done (its awaiter was cancelled) is not kept: it would keep its
        loop alive if the loop had closed since."""
        if fut.done():
            return
        self._pending.append(fut)
        try:
            os.write(self._wfd, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        except BlockingIOError:
            pass  # the reader is already due to run and will drain everything
        except OSError:
            # The loop's fds are gone (loop collected or closed): nobody can be awaiting.
            pass

    def _drain(self) -> None:
        try:
            os.read(self._rfd, 4096)
        except (BlockingIOError, InterruptedError):
            pass
        pending = self._pending
        while pending:
            fut = pending.popleft()
            if not fut.done():
                fut.set_result(None)


def resolve(loop: asyncio.AbstractEventLoop, waker: LoopWaker, fut: asyncio.Future[Any]) -> None:
    """Resolve ``fut`` directly if we are on its loop's thread, else through the waker."""
    # _get_running_loop returns None off-loop instead of raising: cheaper on every completion.
    if asyncio._get_running_loop() is loop:
        if not fut.done():
            fut.set_result(None)
    else:
        waker.post(fut)
