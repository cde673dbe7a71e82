"""Event loops: run coroutines on uvloop when it is installed.

uvloop is the default because its ``call_soon_threadsafe`` and fd wake-ups are cheaper
than the pure-Python loop's, and awaiting communication is all about wake-up latency.
Everything in overlap also works on the default asyncio loop.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Coroutine
from typing import Any, Literal, TypeVar

__all__ = ["LoopKind", "new_event_loop", "pid_alive", "run", "uvloop_available"]

log = logging.getLogger(__name__)

T = TypeVar("T")
LoopKind = Literal["uvloop", "asyncio"]


def uvloop_available() -> bool:
    """True when uvloop can be imported on this platform."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def new_event_loop(kind: LoopKind | None = None) -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop when available (or asked for), else the default loop.

    Asking for ``"uvloop"`` where it is not installed raises ``ImportError`` naming the fix,
    rather than silently running on a slower loop.
    """
    if kind not in (None, "uvloop", "asyncio"):
        raise ValueError(f"unknown loop kind {kind!r}; use 'uvloop', 'asyncio' or None")
    if kind == "asyncio" or (kind is None and not uvloop_available()):
        return asyncio.new_event_loop()
    try:
        import uvloop
    except ImportError as exc:  # pragma: no cover - uvloop is a dependency on POSIX
        raise ImportError("loop='uvloop' needs uvloop: pip install uvloop") from exc
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def run(
    main: Coroutine[Any, Any, T] | Awaitable[T],
    *,
    loop: LoopKind | None = None,
    debug: bool = False,
) -> T:
    """Run ``main`` to completion on a fresh event loop (uvloop by default), like asyncio.run.

    ``main`` is a coroutine or any other awaitable: a Handle (``overlap.run(h)``) or a
    ``comm.collect_all(...)`` is awaited in a coroutine of its own, where asyncio.run
    refused it ("a coroutine was expected, got <Handle ...>"), leaving its ops in flight.

    The loop is closed afterwards, after cancelling leftover tasks and shutting down async
    generators, exactly as :func:`asyncio.run` does.

    Called inside a running loop (an async function, a Jupyter cell), it raises
    RuntimeError saying to ``await`` there instead, with ``main`` untouched: a thread runs
    one loop at a time, and uvloop's own error ("Cannot run the event loop while another
    loop is running") named no fix.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass  # no loop runs in this thread: the usual case
    else:
        raise RuntimeError(
            "overlap.run() was called inside a running event loop (an async function, or a "
            "Jupyter cell): await it there instead (`await main()`, `await handle`); "
            "overlap.run starts a loop of its own, and a thread runs one loop at a time"
        )
    if not asyncio.iscoroutine(main):
        if not inspect.isawaitable(main):
            raise TypeError(
                f"overlap.run takes a coroutine or an awaitable (a Handle), got "
                f"{type(main).__name__}; call the async function: overlap.run(main())"
            )
        main = _awaited(main)
    coro: Coroutine[Any, Any, T] = main
    runner = (
        asyncio.Runner(debug=debug, loop_factory=lambda: new_event_loop(loop))
        if hasattr(asyncio, "Runner")
        else None
    )
    if runner is not None:
        with runner:
            result: T = runner.run(coro)
            return result
    # Python 3.10: no asyncio.Runner.
    ev = new_event_loop(loop)  # pragma: no cover
    try:  # pragma: no cover
        asyncio.set_event_loop(ev)
        ev.set_debug(debug)
        return ev.run_until_complete(coro)
    finally:  # pragma: no cover
        asyncio.set_event_loop(None)
        ev.close()


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (one we may not signal counts as alive): what the
    sweeps of a killed run's leftovers (namespace hosts, shared-memory regions) ask.

    A zombie (exited, not yet reaped by its parent) counts as ended: it can no longer use
    what it made. Ranks killed with their launcher are reparented and stay zombies until
    init reaps them, and counting those as alive let the sweep after a killed host leave
    its shared-memory regions in /dev/shm (measured: 2 runs in 4)."""
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return not _ended(pid)


def _ended(pid: int) -> bool:
    """A zombie, or gone since it was signalled (Linux's /proc; elsewhere: False)."""
    import os

    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:  # ended meanwhile, or no /proc (not Linux)
        return os.path.isdir("/proc/self")
    # "pid (comm) state ...": the command name may itself hold ") ", so the last one ends it
    end = stat.rfind(b")")
    return stat[end + 2 : end + 3] == b"Z"
