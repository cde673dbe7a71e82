"""Handle: one in-flight communication operation, awaitable from asyncio.

A Handle is what every ``async_op=True`` call and every ``isend``/``irecv`` returns. It can be

* awaited (``out = await h``) from any event loop, uvloop or the default one; awaiting never
  blocks the loop: the backend's completion engine resolves the awaiting future;
* combined with ``asyncio.gather``, ``asyncio.wait_for`` and ``asyncio.as_completed``
  (``asyncio.ensure_future(h)`` wraps it in a task), or into one Handle with
  :func:`overlap.comm.collect_all` (no task per handle);
* waited on from plain threads with ``h.wait(timeout=None)``, with no event loop at all;
* polled with ``h.done()`` and inspected with ``h.exception()`` / ``h.result()``.

Ownership contract (DESIGN.md §3.6): a handle holds references to every tensor of its op
until the op completes. Cancelling a task that awaits it, or a timeout around the await,
cancels only the *wait*; the op runs on, its buffers stay alive and untouched, and later ops
work. Failures from backend threads are stored here and raised where the user awaits or
waits, as :class:`~overlap.errors.CommError` with the backend error as ``__cause__``.
"""

from __future__ import annotations

import asyncio
import datetime
import enum
import logging
import sys
import threading
import time
from collections.abc import Callable, Generator
from typing import Any, ClassVar, Protocol

from overlap.comm import hooks as _hooks
from overlap.comm.seconds import wait_seconds
from overlap.comm.waker import LoopWaker, resolve
from overlap.errors import CommTimeoutError

log = logging.getLogger(__name__)

__all__ = ["CompletionEngine", "Handle", "HandleState"]


class _Turn(threading.local):
    # A class attribute, so that reading it never raises (overlap.comm.spin's _Window)
    at = 0.0  # when an await on this thread last let its loop run


_turn = _Turn()
# How long awaits that complete at once may keep a loop from running (see turn_due)
TURN_S = 0.01


def turn_due() -> bool:
    """Whether an await that completes without suspending must still let its loop run once
    (a bare ``yield``, which asyncio's Task takes as ``sleep(0)``): true when no await of
    this thread has done so for :data:`TURN_S`, and then the clock starts again.

    Why: an op awaited on an idle loop is waited for on the loop's own thread (the spin,
    overlap.comm.waiters and overlap.comm.progress), so a small op completes inside the
    await, and ``await`` on a completed handle returns at once, as on a done asyncio
    future. A coroutine whose awaits all completed that way never gave its loop a turn:
    Ctrl-C under ``overlap.run`` (asyncio's runner cancels the main task, which only takes
    effect when the task next suspends), ``asyncio.timeout()``, ``wait_for`` and any other
    task of the loop waited until the loop of awaits ended. Measured (fifty-sixth session,
    awaits of a completed handle, tests/unit/test_handle.py): a Ctrl-C 0.2 s into a 20 s
    loop under ``overlap.run`` was taken only when the loop ended; ``wait_for(..., 0.05)``
    fired after the 5 s loop; another task of the loop got no turn in 0.3 s. One turn every
    10 ms costs one loop iteration (a few us) per 10 ms of awaits."""
    now = time.perf_counter()
    if now - _turn.at < TURN_S:
        return False
    _turn.at = now
    return True


class HandleState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


PENDING, DONE, FAILED = HandleState.PENDING, HandleState.DONE, HandleState.FAILED


class CompletionEngine(Protocol):
    """What a backend provides so a Handle can be waited on and awaited.

    * ``start(handle)``: make sure something is observing the op so it will complete on its
      own (idempotent). Called by ``done()``, ``add_done_callback()`` and when a pending
      handle is garbage-collected, so an op nobody waits for still finishes and keeps its
      tensors alive until then.
    * ``wait(handle, timeout)``: block the calling thread until the op completes or
      ``timeout`` seconds pass; return whether it completed.
    * ``on_await(handle, loop)``: a coroutine on ``loop``'s thread starts awaiting the handle.
    """

    def start(self, handle: Handle) -> None: ...

    def wait(self, handle: Handle, timeout: float | None) -> bool: ...

    def on_await(self, handle: Handle, loop: asyncio.AbstractEventLoop) -> None: ...


class _EventEngine:
    """Default engine: completion is signalled by another thread; waiting blocks on a lock."""

    def start(self, handle: Handle) -> None:
        return None

    def wait(self, handle: Handle, timeout: float | None) -> bool:
        return handle._block_until_done(timeout)

    def on_await(self, handle: Handle, loop: asyncio.AbstractEventLoop) -> None:
        return None


EVENT_ENGINE: CompletionEngine = _EventEngine()


class _OwnEngine:
    """The engine of a handle that is its own completion engine (an MPI op, a
    ``collect_all``): each call goes to the handle's ``_start``, ``_wait`` and
    ``_on_await``. One object per op where a Handle and an engine object cost an
    allocation, a dozen stores and a deallocation more (docs/architecture.md, "Lean ops")."""

    def start(self, handle: Handle) -> None:
        handle._start()  # type: ignore[attr-defined]

    def wait(self, handle: Handle, timeout: float | None) -> bool:
        done: bool = handle._wait(timeout)  # type: ignore[attr-defined]
        return done

    def on_await(self, handle: Handle, loop: asyncio.AbstractEventLoop) -> None:
        handle._on_await(loop)  # type: ignore[attr-defined]


OWN_ENGINE: CompletionEngine = _OwnEngine()

_Waiter = tuple[asyncio.AbstractEventLoop, LoopWaker, "asyncio.Future[Any]"]
_now = time.perf_counter_ns
# Every handle's state changes take this one lock: each is a few stores, never across a wait
# or a callback. A module global, not a per-handle slot: one store fewer per op, and one
# attribute read fewer per state change.
_LOCK = threading.Lock()


class _InCallback(threading.local):
    on = False  # a class default: reading it never raises


# Whether this thread is running a handle's done-callbacks (``_finish``): an op issued
# there must not wait for another (overlap.comm.claims), as a callback must never block
IN_CALLBACK = _InCallback()

# The async ops in flight that claim tensors (overlap.comm.claims): id(handle) -> a weak
# reference to it, dropped by _finish. Kept here so that completing an op needs no import.
CLAIMS: dict[int, Any] = {}


def _format_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def _call(fn: Callable[[Handle], None], handle: Handle) -> None:
    """Run one done-callback; what it raises is logged, never passed on to the thread that
    completed the op (a backend's, the waiter pool's, the MPI progress engine's)."""
    try:
        fn(handle)
    except Exception:
        log.exception(
            "a done-callback of %r raised; the handle's other callbacks still run", handle
        )


class Handle:
    """One in-flight op. Created by a backend, never by users.

    Attributes ``op``, ``nbytes`` (bytes this rank contributes), ``group`` (a printable group
    name), ``backend``, ``start_ns`` and ``end_ns`` (``time.perf_counter_ns`` at issue and at
    completion, ``None`` while pending) describe the op for tracing and for ``repr``.

    Built for a small per-op cost (docs/architecture.md, "Lean ops"): nothing is allocated
    at construction; state changes take one process-wide lock for a few stores (never
    across a wait or a callback), and the waiter list, the callback list and the lock a
    blocked thread sleeps on are made only when someone needs them.
    """

    __slots__ = (
        "__weakref__",
        "_callbacks",
        "_claim",
        "_done_lock",
        "_engine",
        "_exc",
        "_keep",
        "_result",
        "_source",
        "_state",
        "_waiters",
        "backend",
        "end_ns",
        "group",
        "nbytes",
        "op",
        "start_ns",
        "world",
    )

    # A receive's sender (see ``source``): set only on receives, so declared, not assigned
    _source: int | Callable[[], int | None] | None

    # False for a handle that stands for other handles (overlap.comm.collect): its ops
    # report themselves, so a tracer sees each op once.
    _observed: ClassVar[bool] = True

    def __init__(
        self,
        op: str,
        result: Any = None,
        nbytes: int = 0,
        group: str = "world",
        backend: str = "",
        keep: Any = None,
        engine: CompletionEngine = EVENT_ENGINE,
        world: int = 1,
    ) -> None:
        self.op = op
        self.world = world
        self.nbytes = nbytes
        self.group = group
        self.backend = backend
        self.start_ns = _now()
        self.end_ns: int | None = None
        self._result = result
        self._keep = keep  # inputs and scratch buffers, released at completion
        self._engine = engine
        self._state = PENDING
        self._exc: BaseException | None = None
        self._done_lock: threading.Lock | None = None  # made by the first blocked thread
        self._waiters: list[_Waiter] | None = None
        self._callbacks: list[Callable[[Handle], None]] | None = None
        self._claim: Any = None  # the tensors' claim while in flight (overlap.comm.claims)

    # ----------------------------------------------------------------- construction helpers
    @classmethod
    def completed(
        cls, op: str, result: Any, *, nbytes: int = 0, group: str = "world", backend: str = ""
    ) -> Handle:
        """A handle that is already done (world size 1, empty tensors, local no-ops)."""
        h = cls(op, result=result, nbytes=nbytes, group=group, backend=backend)
        h._finish(None)
        return h

    # ------------------------------------------------------------------------ backend side
    def _finish(self, exc: BaseException | None) -> None:
        """Mark the op complete (``exc`` is None) or failed. Any thread; idempotent; never blocks.

        Safe inside a torch future callback: it only takes a short internal lock and hands the
        result to waiting loops through their wakers (DESIGN.md §3.2).
        """
        with _LOCK:
            if self._state is not PENDING:
                return
            self.end_ns = end = _now()
            self._exc = exc
            self._state = FAILED if exc is not None else DONE
            waiters, self._waiters = self._waiters, None
            callbacks, self._callbacks = self._callbacks, None
            done_lock = self._done_lock
            self._keep = None
        if CLAIMS:  # its tensors may be claimed (overlap.comm.claims)
            CLAIMS.pop(id(self), None)
        if done_lock is not None:
            done_lock.release()
        obs = _hooks.observer
        if obs is not None and self._observed:
            obs(self.op, self.start_ns, end, self.nbytes, self.group, self.backend, self.world)
        if waiters:
            for loop, waker, fut in waiters:
                resolve(loop, waker, fut)
        if callbacks:
            outer = IN_CALLBACK.on
            IN_CALLBACK.on = True
            try:
                for cb in callbacks:
                    _call(cb, self)
            finally:
                IN_CALLBACK.on = outer

    def _block_until_done(self, timeout: float | None) -> bool:
        if self._state is not PENDING:
            return True
        with _LOCK:
            if self._state is not PENDING:
                return True
            lock = self._done_lock
            if lock is None:
                lock = self._done_lock = threading.Lock()
                lock.acquire()  # released exactly once, by _finish
        acquired = lock.acquire() if timeout is None else lock.acquire(timeout=max(timeout, 0.0))
        if acquired:
            lock.release()  # let the next blocked thread through
        return acquired

    # --------------------------------------------------------------------------- user side
    def done(self) -> bool:
        """True once the op has completed or failed (starts observing the op if needed)."""
        if self._state is PENDING:
            self._engine.start(self)
            return self._state is not PENDING
        return True

    def is_completed(self) -> bool:
        """:meth:`done` under torch's name (``Work.is_completed()``), so code written for
        ``torch.distributed``'s async handles runs unchanged: True once the op has completed
        or failed, never blocking."""
        return self.done()

    def get_future(self) -> Any:
        """A ``torch.futures.Future`` that completes with this op, under torch ``Work``'s
        name, so code written for ``torch.distributed``'s async handles runs unchanged: DDP
        comm hooks return ``all_reduce(..., async_op=True).get_future().then(...)``.

        Its value is what torch's holds: a list of the op's tensors (``[tensor]`` for an
        in-place op, the output list for a gather, ``[]`` for barrier and send). A failed op
        sets the future's exception: ``wait()`` / ``value()`` raise the CommError (inside a
        ``then`` callback torch wraps it in a RuntimeError). As with
        :meth:`add_done_callback`, the future completes, and its ``then`` callbacks run, on
        whatever thread completes the op: keep them quick and non-blocking."""
        import torch  # here: handle.py stays free of torch for its per-op cost

        fut: Any = torch.futures.Future()

        def settle(h: Handle) -> None:
            if h._exc is not None:
                fut.set_exception(h._exc)
            else:
                fut.set_result(_future_value(h._result))

        self.add_done_callback(settle)
        return fut

    @property
    def state(self) -> HandleState:
        return self._state

    @property
    def source(self) -> int | None:
        """For a receive (``irecv``, a receive of ``batch_isend_irecv``): the global rank whose
        message landed, once the handle has completed; the point of asking is
        ``irecv(src=None)``, which takes a message from any rank (torch's
        ``Work._source_rank()``, MPI's ``Status.Get_source()``). None while in flight, after
        a failure, and for every other op."""
        if self._state is not DONE:
            return None
        # set by the backend right after issuing a receive (never at construction, so other
        # ops pay nothing): the rank, or a function that reads it from the completed op
        src = getattr(self, "_source", None)
        return src() if callable(src) else src

    def source_rank(self) -> int:
        """:attr:`source` under torch ``Work``'s name, for code written for
        ``torch.distributed``'s ``irecv(src=None)``: the sender's global rank. Raises
        RuntimeError while the receive is in flight (wait or await it first), after it
        failed, and for any op that is not a receive, as torch's does for a non-receive."""
        src = self.source
        if src is None:
            what = (
                "still in flight"
                if self._state is PENDING
                else ("failed" if self._exc is not None else "not a receive")
            )
            raise RuntimeError(
                f"source_rank(): {self!r} is {what}; it names the sender of a completed "
                "receive (irecv or a receive of batch_isend_irecv): wait() or await it first"
            )
        return src

    def is_success(self) -> bool:
        """True once the op has completed without error (torch ``Work``'s name). False
        while it is in flight, where torch's answers "no error yet", which reads as done."""
        return self.done() and self._exc is None

    def synchronize(self) -> None:
        """Wait for the op, raising its error (torch ``Work``'s name). torch's makes only
        the current CUDA stream wait on NCCL and does nothing on gloo; this waits on the
        host, which orders every later use of the op's tensors, on any stream."""
        self.wait()

    def block_current_stream(self) -> None:
        """:meth:`synchronize` under torch ``Work``'s newer name (the same host wait)."""
        self.wait()

    def exception(self) -> BaseException | None:
        """The op's error, or None if it succeeded. Raises InvalidStateError while pending."""
        if self._state is PENDING:
            raise asyncio.InvalidStateError(
                f"{self!r} is still in flight: await it or call wait() before exception()"
            )
        return self._exc

    def result(self) -> Any:
        """The op's result (see :meth:`wait`). Raises InvalidStateError while pending."""
        if self._state is PENDING:
            raise asyncio.InvalidStateError(
                f"{self!r} is still in flight: await it or call wait() before result()"
            )
        if self._exc is not None:
            raise self._exc
        return self._result

    def wait(self, timeout: float | datetime.timedelta | None = None) -> Any:
        """Block until the op completes and return its result; works without an event loop.

        The result is the in-place tensor for ops like all_reduce or broadcast, the output
        list or tensor for gathers, ``None`` for barrier and send. A failed op raises
        :class:`~overlap.errors.CommError`. If ``timeout`` seconds pass first,
        :class:`~overlap.errors.CommTimeoutError` is raised and the op stays in flight,
        still owning its tensors: the timeout is taken here, never by timing out the
        backend's receive (which would break the connection for later ops). ``timeout``:
        seconds or a timedelta; 0 polls, ``None`` or ``math.inf`` waits for ever.
        """
        if timeout is not None:
            timeout = wait_seconds(timeout)  # a timedelta, inf (None), or a clear error
        if self._state is PENDING and not self._engine.wait(self, timeout):
            raise CommTimeoutError(
                f"{self!r} did not complete within {timeout} s. The op is still in flight and "
                "keeps its tensors; wait again, or check that every rank issued the same op"
            )
        return self.result()

    def add_done_callback(self, fn: Callable[[Handle], None]) -> None:
        """Call ``fn(handle)`` once the op completes (at once if it already has).

        ``fn`` may run on a backend thread: it must be quick and must not block or wait on
        other handles. An exception it raises is logged (logger ``overlap.comm.handle``)
        and goes no further, as with ``concurrent.futures``: the handle's other callbacks
        still run, and so does the engine that completed it. Before, the first raising
        callback skipped the rest, overlap's own among them: a ``collect_all`` of the
        handle never returned, and on MPI every later async op of the process hung.
        """
        if self._subscribe(fn):
            self._engine.start(self)
        else:
            _call(fn, self)

    def _subscribe(self, fn: Callable[[Handle], None]) -> bool:
        """Register ``fn`` for the completion without starting the engine (the caller
        observes the op itself); False, and ``fn`` not kept, if the op is already over."""
        with _LOCK:
            if self._state is not PENDING:
                return False
            if self._callbacks is None:
                self._callbacks = []
            self._callbacks.append(fn)
            return True

    def __del__(self) -> None:
        # Dropped while in flight: let the engine observe the op to the end. The engine keeps
        # this handle (and so the op's tensors) alive until then; gloo must not see a Work
        # freed mid-flight.
        # Not at interpreter exit: threads cannot start then, and Thread.start() would wait
        # forever (measured: a survivor of a killed peer hung at exit).
        if self._state is not PENDING or sys.is_finalizing():
            return
        try:
            self._engine.start(self)
        except Exception:  # a half-torn-down interpreter: nothing left to protect
            pass

    def __await__(self) -> Generator[Any, None, Any]:
        if self._state is PENDING:
            loop = asyncio.get_running_loop()
            # The engine may finish the op right here (an MPI request that completes within
            # a short spin, a gloo future that is already done): then no future is made.
            self._engine.on_await(self, loop)
            if self._state is PENDING:
                yield from self._suspend(loop)
                return self.result()
        if turn_due():
            yield  # a bare yield: the loop runs once (see turn_due)
        return self.result()

    def _suspend(self, loop: asyncio.AbstractEventLoop) -> Generator[Any, None, None]:
        """Suspend the awaiting coroutine on ``loop`` until the op completes (``_finish``
        resolves its future through the loop's waker). Cancelling or timing out the await
        forgets this waiter and leaves the op alone."""
        waker = LoopWaker.for_loop(loop)
        fut: asyncio.Future[Any] = loop.create_future()
        entry = (loop, waker, fut)
        with _LOCK:
            if self._state is not PENDING:
                return
            if self._waiters is None:
                self._waiters = []
            self._waiters.append(entry)
        try:
            yield from fut
            _turn.at = time.perf_counter()
        except BaseException:
            with _LOCK:
                if self._waiters is not None and entry in self._waiters:
                    self._waiters.remove(entry)
            raise

    def __reduce__(self) -> Any:
        raise TypeError(
            f"a Handle cannot be pickled or copied: it is a {self.op} in flight in this "
            "process. Pickle what h.wait() (or await h) returns instead"
        )

    def __repr__(self) -> str:
        return (
            f"<Handle {self.op} {_format_bytes(self.nbytes)} group={self.group} "
            f"backend={self.backend or '?'} state={self._state.value}>"
        )


def _future_value(result: Any) -> list[Any]:
    """A Handle's result as torch's Work future holds it: a list of tensors."""
    if result is None:
        return []
    if isinstance(result, list):
        return result
    if isinstance(result, tuple):
        return list(result)
    return [result]
