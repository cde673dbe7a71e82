"""The fault-injection tools (see the package docstring). All act on this process only:
call them inside a rank (a RankPool function, or a script under mpiexec).

* :class:`FaultAt`: at this rank's n-th call of a backend op (``"all_reduce"``,
  ``"broadcast"``, ``"isend"``, ...), before the op is issued, ``"kill"`` the process
  (SIGKILL), ``"stop"`` it (SIGSTOP; a detached ``sleep; kill -CONT`` resumes it after
  ``stop_s``), or ``"raise"`` :class:`InjectedFault`. Counts every call through the active
  backend, blocking or async, and restores the backend on exit.
* :func:`issue_and_drop`: issue an async op and keep no reference to its handle.
* :func:`abandon_await`: await a handle on a fresh loop that gives up after ``after_s`` and
  closes, with the op still in flight.
* :func:`on_rank`: one value on the given rank(s), another everywhere else.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import overlap
from overlap.comm import state

__all__ = ["FaultAt", "InjectedFault", "abandon_await", "issue_and_drop", "on_rank"]


class InjectedFault(RuntimeError):
    """Raised by a ``"raise"`` fault: the op was never issued on this rank."""


class FaultAt:
    """``with FaultAt("all_reduce", 3, "kill", ranks=[1]): ...`` (see the module docstring)."""

    def __init__(
        self,
        op: str,
        n: int,
        action: str,
        *,
        ranks: Iterable[int] | None = None,
        stop_s: float = 5.0,
    ) -> None:
        if action not in ("kill", "stop", "raise"):
            raise ValueError(f"action must be 'kill', 'stop' or 'raise', got {action!r}")
        if n < 1:
            raise ValueError(f"n counts calls from 1, got {n}")
        self.op, self.n, self.action, self.stop_s = op, n, action, stop_s
        self.ranks = None if ranks is None else set(ranks)
        self.calls = 0
        self.fired = False
        self._backend: Any = None
        self._original: Any = None

    def __enter__(self) -> FaultAt:
        from overlap import comm

        if self.ranks is not None and comm.get_rank() not in self.ranks:
            return self
        backend = state.active()
        original = getattr(backend, self.op)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.calls == self.n and not self.fired:
                self.fired = True
                self._fire()
            return original(*args, **kwargs)

        self._backend, self._original = backend, original
        setattr(backend, self.op, wrapped)  # an instance attribute: the class is untouched
        return self

    def _fire(self) -> None:
        pid = os.getpid()
        if self.action == "kill":
            os.kill(pid, signal.SIGKILL)
        elif self.action == "stop":
            subprocess.Popen(
                ["sh", "-c", f"sleep {self.stop_s}; kill -CONT {pid}"], start_new_session=True
            )
            os.kill(pid, signal.SIGSTOP)
        else:
            raise InjectedFault(f"injected fault at call {self.n} of {self.op}")

    def __exit__(self, *exc: object) -> None:
        if self._backend is not None:
            delattr(self._backend, self.op)
            self._backend = None


def issue_and_drop(issue: Callable[[], Any]) -> weakref.ref[Any]:
    """Call ``issue()`` (it returns a Handle) and drop the handle; a weak reference to it."""
    ref = weakref.ref(issue())
    gc.collect()
    return ref


def abandon_await(handle: Any, after_s: float, loop: str = "uvloop") -> bool:
    """Await ``handle`` on a fresh loop for at most ``after_s``, then close that loop; True if
    the wait timed out (the op is still in flight, on no loop)."""

    async def wait() -> Any:
        return await asyncio.wait_for(handle, after_s)

    try:
        overlap.run(wait(), loop=loop)  # type: ignore[arg-type]
    except (asyncio.TimeoutError, TimeoutError):
        return True
    return False


def on_rank(ranks: int | Iterable[int], here: Any, elsewhere: Any) -> Any:
    """``here`` on the given rank(s), ``elsewhere`` on the others."""
    from overlap import comm

    chosen = {ranks} if isinstance(ranks, int) else set(ranks)
    return here if comm.get_rank() in chosen else elsewhere
