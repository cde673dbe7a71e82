"""Coroutines that an object's async methods hand out, and the ones that never ran.

``diloco.astep()`` written without ``await`` builds a coroutine and drops it: the step never
runs. Python only warns when the coroutine is collected ("coroutine ... was never
awaited"), and training goes on: measured on 2 gloo ranks, a DiLoCo loop of un-awaited
``astep()`` calls never synced, and the ranks' weights drifted apart with no error; an
un-awaited ``sched.backward(loss)`` left every ``.grad`` None, so the model never trained.

:class:`Unawaited` wraps each coroutine such a method returns. The wrapper notes when it
starts, and a ``weakref.finalize`` on it notes one collected before it started (under
CPython that is as soon as the caller drops it). The owner's next call raises a
RuntimeError that names the call and the fix. The coroutine a caller keeps (a task made
with ``asyncio.create_task``, an ``asyncio.gather`` of several) is never flagged, whatever
the order it starts in, so calls made concurrently on purpose still run. One that was
cancelled before it began is flagged too: its step did not run either.
"""

from __future__ import annotations

import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["Unawaited"]

T = TypeVar("T")


async def _noting_start(started: list[bool], coro: Coroutine[Any, Any, T]) -> T:
    started[0] = True
    return await coro


class Unawaited:
    """The calls of one object whose coroutines were collected before they ran.

    ``watch(call, coro)`` returns ``coro`` wrapped; ``check()`` raises RuntimeError for any
    that never ran since the last check, naming ``call`` (e.g. ``"diloco.astep()"``).
    ``what`` says what a call that never ran leaves behind, for the message."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._never_ran: list[str] = []

    def watch(self, call: str, coro: Coroutine[Any, Any, T]) -> Coroutine[Any, Any, T]:
        try:
            self.check()
        except RuntimeError:
            coro.close()  # this call does not run either; Python need not warn about it too
            raise
        started = [False]
        outer = _noting_start(started, coro)
        # Python's own warning for a dropped one then names the call, not this wrapper
        outer.__qualname__ = call  # type: ignore[attr-defined]
        weakref.finalize(outer, self._collected, call, started, coro)
        return outer

    def _collected(self, call: str, started: list[bool], coro: Coroutine[Any, Any, Any]) -> None:
        if not started[0]:
            coro.close()  # never ran either: no second "never awaited" warning for it
            self._never_ran.append(call)

    def check(self) -> None:
        if not self._never_ran:
            return
        calls, self._never_ran = self._never_ran, []
        n = len(calls)
        raise RuntimeError(
            f"{calls[0]} was called{f' ({n} times)' if n > 1 else ''} but never ran: the "
            "coroutine it returned was not awaited (or was cancelled before it began), so "
            f"{self._what}. Write `await {calls[0]}` (or keep the task of "
            f"`asyncio.create_task({calls[0]})`)"
        )
