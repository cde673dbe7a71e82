"""The MPI progress engine: MPI requests made awaitable without a thread per request.

MPI has no completion callbacks and makes progress only inside MPI calls (DESIGN.md §3.5).
So each event loop that awaits MPI handles gets one :class:`ProgressEngine`:

* while anything is in flight it tests pending requests once per loop tick (a
  ``call_soon`` chain: other tasks and I/O run between two ticks; sends and collectives
  with one ``Testsome``, receives one by one, see ``_Poller._test_held``): the oldest few
  and a window rotating over the rest (:class:`_Poller`), so a tick costs the same with 10
  or 10,000 in flight;
* after ``busy_s`` seconds without any completion (a receive waiting for a slow peer, not
  an op waiting for progress) it backs off, doubling the delay up to 1 ms, and returns to
  every-tick polling as soon as anything completes or a new op is awaited. It does not
  back off while the process has more MPI ops open than it polls (:func:`others_open`):
  MPI then has work it moves only inside MPI calls, and the awaited op may be waiting
  behind it. Awaiting the last of 4,000 all_reduces first took 8.7 s with the back-off
  (MPI called once a millisecond) against 0.9 s for an mpi4py ``Test`` loop;
* with nothing in flight it does not run at all;
* the first op awaited on an idle loop is tested in a tight loop for up to 1 ms
  (``OVERLAP_MPI_SPIN_US``; the ops of one ``collect_all`` share one window,
  overlap.comm.spin) before joining the ticks: small ops then complete without two
  loop round trips, and ops up to about 4 MiB without any. Measured on 2 ranks: an
  awaited 8-byte Iallreduce took 21.7 us with no spin and 12.5 us with a 20 us spin.
  An op that outlasts the spin costs 10-17% more than mpi4py's Iallreduce + Wait until
  about 16 MiB (its future, and the loop round trips between ticks, in which this rank
  makes no MPI call and the op does not move), so the window is set by the slowest machine's
  time for the sizes that matter: 200 us covered 1 MiB where it took 140 us, not where it
  took 240-310 us (a later 2-core machine, the lent 16-core one), and there 1 ms made an
  awaited 1 MiB all_reduce 1.11x mpi4py's instead of 1.23x, and 4 MiB 1.05x instead of
  1.16x (docs/benchmarks.md). The window only bounds how long the loop is held for an op
  that has not finished by then;
* each later tick first tests the oldest pending request in a tight loop for up to 20 us
  (``OVERLAP_MPI_TICK_SPIN_US``; not while backing off), then polls the batch. MPI moves a
  large message a piece per MPI call, so the rate of calls sets its speed, and a batch
  ``Testsome`` plus a loop round trip per piece made an awaited 64 KiB all_reduce take 156 us
  against 49 us for mpi4py's Iallreduce + Wait (2 ranks); with the spin, 58-74 us. Spinning
  with the batch poll instead (a ``Testsome`` over a status list per call) gained nothing.
  A spin takes the op's lock once, not per Test (:meth:`MpiOp.spin`).

Measured figures behind these choices (DESIGN.md): tight polling costs about 1-3 us over a
blocking ``MPI_Wait``; 1 ms polling made a 64 KiB Iallreduce take 5.5 ms instead of 76 us;
thread hand-offs cost 40-120 us.

An op is completed by whoever holds its lock: the engine (which only try-locks, so it never
waits), a thread in ``h.wait()`` (``MPI_Wait`` without a timeout, a ``Test`` loop with one),
or ``h.done()`` (one ``Test``). MPI forbids completing one request from two threads at once;
the lock is what prevents it. Handles that are dropped, or given a callback, outside any loop
go to one background "reaper" thread per process that polls them with the same back-off.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import threading
import time
import weakref
from collections.abc import Callable, Generator
from typing import Any, ClassVar

from overlap.comm import knobs as _knobs
from overlap.comm import spin as _spin
from overlap.comm.handle import FAILED, OWN_ENGINE, PENDING, Handle, _now, turn_due
from overlap.errors import CommError, CommTimeoutError

__all__ = ["MpiOp", "ProgressEngine", "spin_together", "stop_reaper"]

log = logging.getLogger(__name__)

PostFn = Callable[[Any], object]  # called with the MPI.Status of the completed request

BUSY_S = 0.5
MAX_DELAY_S = 1e-3
_graveyard: list[Any] = []  # requests that expired: MPI may still use their buffers
# MpiOps made and not yet finished, in this process. Changed without a lock: ``+= 1`` on a
# global is not interrupted by another Python thread in CPython with the GIL (no eval-breaker
# check between the load and the store), and it only decides whether polling may back off.
_open = 0


def others_open(polled: int) -> bool:
    """Whether this process has more MPI ops open than the ``polled`` a waiter tests: then
    MPI has other work, which it moves only inside MPI calls, and the op waited on may be
    waiting behind it (collectives on a communicator complete in issue order), so the
    waiter must keep calling MPI rather than back off."""
    return _open > polled


SPIN_S = _knobs.number("OVERLAP_MPI_SPIN_US", 1000, low=0, high=1e5, unit="microseconds") * 1e-6
TICK_SPIN_S = (
    _knobs.number("OVERLAP_MPI_TICK_SPIN_US", 20, low=0, high=1e5, unit="microseconds") * 1e-6
)


class MpiOp(Handle):
    """One MPI request and the Handle the user holds for it, in one object.

    The Handle of an MPI op is its own completion engine's state (the request, its
    post-processing, its lock): one object per op, where a Handle and a separate engine
    object cost an allocation, a dozen stores and a deallocation more per op. The
    CompletionEngine calls go through :data:`~overlap.comm.handle.OWN_ENGINE` to the methods
    below.
    """

    __slots__ = ("MPI", "deadline", "lock", "post", "rank", "req", "status")

    # Whether completing the op reads the request's Status (a receive's sender and size):
    # a Status is made only then, or when there is a ``post``.
    reads_status: ClassVar[bool] = False

    def __init__(
        self,
        op: str,
        result: Any,
        nbytes: int,
        group: str,
        keep: Any,
        world: int,
        MPI: Any,
        req: Any,
        post: PostFn | None,
        rank: int,
        timeout: float | None = None,
    ) -> None:
        global _open
        # Handle.__init__'s stores, written out: the call frame cost 0.2 us of the 1 us an
        # op's handle took to make (single process), on every MPI op.
        self.op = op
        self.world = world
        self.nbytes = nbytes
        self.group = group
        self.backend = "mpi"
        self.start_ns = _now()
        self.end_ns = None
        self._result = result
        self._keep = keep
        self._engine = OWN_ENGINE
        self._state = PENDING
        self._exc = None
        self._done_lock = None
        self._waiters = None
        self._callbacks = None
        self._claim = None
        _open += 1
        self.MPI = MPI
        self.req = req
        self.post = post
        self.rank = rank
        self.lock = threading.Lock()  # whoever holds it may Test or Wait the request
        # The Status the last Test or Wait filled (see _recover)
        self.status: Any = None
        # The job timeout (init_distributed(timeout=...)): past it the op fails with
        # CommTimeoutError instead of waiting on a peer that may have died.
        self.deadline = None if timeout is None else time.monotonic() + timeout

    def expire(self) -> None:
        """Fail the op with CommTimeoutError (call with the lock held, or from the engine).

        MPI cannot cancel a collective, so the request and its buffers are kept alive for
        good: MPI may still write into them.
        """
        _closed()
        _graveyard.append((self.req, self._keep, self._result))
        self._finish(
            CommTimeoutError(
                f"{self.op} on rank {self.rank} (group {self.group}) did not complete within "
                "the job timeout given to init_distributed(timeout=...): a peer may have died, "
                "or not issued the same op"
            )
        )

    def overdue(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    # Called with self.lock held, once the request is complete.
    def _complete(self, status: Any) -> None:
        global _open
        _open -= 1  # _closed(), written out: every op that completes passes here
        if self.post is not None:
            try:
                self.post(status)
            except BaseException as exc:
                self._finish(_wrap(exc, self, self.rank))
                return
        self._finish(None)

    def _fail(self, exc: BaseException) -> None:
        _closed()
        self._finish(_wrap(exc, self, self.rank))

    def __await__(self) -> Generator[Any, None, Any]:
        """:meth:`Handle.__await__`, with the common case written out: the only MPI op open
        in the process is awaited, so nothing else can be pending on this loop's engine,
        and the op is tested in a tight loop for up to SPIN_S (as ``_on_await`` would) with
        no loop or engine looked up. A ``collect_all``'s shared spin window does not apply:
        it exists only inside ``collect_all``'s own observation of its handles, never
        around an ``await``. On 2 ranks, 8 bytes, in a tight loop: an awaited all_reduce
        10.8-11.2 -> 9.5-9.9 us, mpi4py's Iallreduce + Wait 3.4-3.5 (docs/architecture.md,
        "The awaited op's own path")."""
        if self._state is PENDING:
            if not (_open == 1 and SPIN_S > 0):
                return (yield from Handle.__await__(self))  # the general path
            if not self.spin(SPIN_S):
                loop = asyncio.get_running_loop()
                ProgressEngine.for_loop(loop).add(self)
                yield from self._suspend(loop)
        # completed without suspending: the loop's turn (overlap.comm.handle.turn_due); after
        # a suspension it is never due, as _suspend has just started the clock again
        if turn_due():
            yield
        if self._exc is not None:
            raise self._exc
        return self._result

    def test(self) -> bool:
        """One non-blocking Test if nobody else holds the op; True once the op is done."""
        return self.spin(0.0)

    def spin(self, seconds: float) -> bool:
        """Test in a tight loop for up to ``seconds`` (at least once) if nobody else holds
        the op; True once the op is done.

        The lock is taken, and the Status made, once for the whole spin, not per Test: MPI
        moves a large message a piece per MPI call, so the rate of calls sets its speed. A
        ``test()`` per iteration (a lock and a Status each) made an awaited all_reduce take
        1.24x mpi4py's Iallreduce + Wait at 64 KiB and 1.10-1.13x at 1 MiB; one lock per
        spin, 1.12-1.13x and 1.06-1.08x (2 ranks, side by side in one run).
        """
        if self._state is not PENDING:
            return True
        lock = self.lock
        if not lock.acquire(False):
            return False
        try:
            if self._state is not PENDING:
                return True
            if not self.req:  # freed by an interrupted Test or Wait (_freed): its Status kept
                self._complete(self.status)
                return True
            # A Status only where the post-processing reads it (irecv's sender).
            status = self.status = self.MPI.Status() if self.post or self.reads_status else None
            test = self.req.Test
            try:
                # One Test before the clock is read: a small op is often done by now.
                if not test(status):
                    clock = time.perf_counter
                    deadline = clock() + seconds
                    while not test(status):
                        if clock() >= deadline:
                            return False
            except Exception as exc:
                self._fail(exc)
                return True
            self._complete(status)
            return True
        finally:
            lock.release()

    def _freed(self) -> bool:
        """MPI completed (and freed) the request while the op stayed pending: a signal
        (Ctrl-C) was raised in the waiting thread between the Test or Wait that completed
        it and the handle's completion. Testing the freed request would report an empty
        status (a receive from rank -2 of 0 bytes), so the op is completed with
        ``self.status``, the one that Test or Wait filled."""
        return self._state is PENDING and not self.req  # MPI_REQUEST_NULL is falsy

    def _recover(self) -> None:
        if self._freed():
            with self.lock:
                if self._freed():
                    self._complete(self.status)

    # ------------------------------------------------------ what OWN_ENGINE calls (below)
    def _start(self) -> None:
        self._recover()
        if self.test():
            return
        loop = asyncio._get_running_loop()
        if loop is not None:
            ProgressEngine.for_loop(loop).add(self)
        else:
            _reaper().add(self)

    def wait(self, timeout: float | datetime.timedelta | None = None) -> Any:
        """:meth:`Handle.wait`; the common case (no timeout anywhere, the op pending) goes
        straight to ``MPI_Wait``, two calls shorter. With only a job timeout, one spin of
        up to SPIN_S first (as an await's): most ops finish inside it, and only an op still
        pending then takes the general path, which enforces the timeout. An op that is
        over already (a send the test at its post finished) returns its result at once,
        written out here: ``result()``'s call frame, and ``Handle.wait``'s for an op that is
        over, are on every blocking MPI call's path (docs/architecture.md, "The awaited
        pair's own path")."""
        if timeout is None:
            if self._state is PENDING:
                if self.deadline is None:
                    self._wait_forever()
                elif not self.spin(SPIN_S):
                    return Handle.wait(self, timeout)
            if self._exc is None and self._state is not PENDING:
                return self._result
            return self.result()
        return Handle.wait(self, timeout)

    def _wait_forever(self) -> None:
        """MPI's own Wait (mpi4py releases the GIL), under the op's lock."""
        with self.lock:
            if self._state is not PENDING:
                return
            if not self.req:  # MPI_REQUEST_NULL: freed by an interrupted wait (_freed)
                self._complete(self.status)
                return
            status = self.status = self.MPI.Status() if self.post or self.reads_status else None
            try:
                self.req.Wait(status)
            except Exception as exc:
                self._fail(exc)
                return
            except (KeyboardInterrupt, SystemExit):
                # Ctrl-C: raised once MPI_Wait has returned (or before it began): complete
                # the op if MPI did (a receive keeps its sender and size), else leave it
                # pending.
                if self._freed():
                    self._complete(status)
                raise
            self._complete(status)

    def _wait(self, timeout: float | None) -> bool:
        if timeout is None and self.deadline is None:
            self._wait_forever()
            return True
        self._recover()
        if timeout is None:
            # A job timeout is configured: poll (tightly, then backing off) up to it.
            assert self.deadline is not None
            if not self._wait_until(self.deadline):
                with self.lock:
                    if self._state is PENDING:
                        self.expire()
            return True
        deadline = time.monotonic() + max(timeout, 0.0)
        if self.deadline is not None and self.deadline < deadline:
            if not self._wait_until(self.deadline):
                with self.lock:
                    if self._state is PENDING:
                        self.expire()
            return True
        return self._wait_until(deadline)

    def _wait_until(self, deadline: float) -> bool:
        """Test until done or ``deadline`` (monotonic): tight for BUSY_S, then backing off.

        First one spin of up to SPIN_S (an await's: the lock and the Status once, ``Test``
        in a bare loop), where a ``test()`` per iteration takes the lock and makes a Status
        each time: with a job timeout, the blocking 8-byte all_reduce took 3.0x mpi4py's
        Iallreduce + Wait (2 ranks; docs/architecture.md, "A job timeout on the ready path")."""
        start = time.monotonic()
        if self.spin(min(SPIN_S, max(deadline - start, 0.0))):
            return True
        delay = 1e-5
        while True:
            if self.test():
                return True
            now = time.monotonic()
            if now >= deadline:
                return False
            if now - start > BUSY_S and not others_open(1):
                time.sleep(min(delay, deadline - now))
                delay = min(delay * 2, MAX_DELAY_S)

    def _on_await(self, loop: asyncio.AbstractEventLoop) -> None:
        engine = ProgressEngine.for_loop(loop)
        # Nothing else to progress on this loop: test this request in a tight loop for up
        # to SPIN_S, as MPI_Wait would, so the op completes without loop round trips.
        # Bounded, so the loop is never held longer than a short callback. The handle is
        # then done before the awaiting coroutine makes any future.
        # Inside a collect_all the handles share one window (overlap.comm.spin).
        if not engine.has_pending() and SPIN_S > 0:
            seconds = _spin.window(SPIN_S)
            if seconds > 0 and self.spin(seconds):
                return
        engine.add(self)


def spin_together(handles: list[Handle]) -> bool | None:
    """``await collect_all(handles)``'s common case on MPI, written out as a lone await's
    (:meth:`MpiOp.__await__`): when every pending handle is an MpiOp and they are all the
    MPI ops open in the process, nothing else can be pending on this loop's engine, so they
    are tested in a tight loop in order, one window of SPIN_S for all of them (as
    ``collect_all``'s shared window), with no loop, engine or window looked up. True when
    every handle is done or one has failed (the caller settles); False when the window ran
    out first (the caller hands the rest to the engine, with no second spin); None when this
    case does not apply (another op is open, or a handle is not an MpiOp): nothing tested.

    Why: an awaited 8-byte MPI sendrecv (``collect_all`` of an irecv and an isend) took
    11.3-11.7 us on 2 ranks, awaiting the two handles one after the other 7.8-7.9
    (docs/architecture.md, "The awaited pair's own path")."""
    ops: list[MpiOp] = []
    for h in handles:
        state = h._state
        if state is PENDING:
            if not isinstance(h, MpiOp):
                return None
            ops.append(h)
        elif state is FAILED:
            return True
    if not ops:
        return True
    if len(ops) != _open or SPIN_S <= 0:
        return None
    clock = time.perf_counter
    end = clock() + SPIN_S
    for op in ops:
        if not op.spin(max(end - clock(), 0.0)):
            return False
        if op._state is FAILED:
            return True
    return True


def _closed() -> None:
    """An MpiOp's handle finished (each does once: called from ``_complete``, ``_fail`` or
    ``expire``, with the handle pending and the op's lock held)."""
    global _open
    _open -= 1


def _wrap(exc: BaseException, handle: Handle, rank: int) -> BaseException:
    if isinstance(exc, CommError):
        return exc
    err = CommError(f"{handle.op} on rank {rank} (group {handle.group}) failed: {exc}")
    err.__cause__ = exc
    return err


BATCH = 8  # requests tested per tick from the front, and again from a rotating window


class _Poller:
    """Shared bookkeeping: pending ops in issue order, and one test per poll of at most
    2 x BATCH of them (``_test_held``).

    Testing every pending request on every tick made n requests in flight cost O(n^2):
    10,000 awaited all_reduces took 37.6 s against 6.1 s for mpi4py's Waitall (issue
    hardening, item 22). A poll now tests the BATCH oldest pending requests (collectives on
    a communicator complete in issue order, so those are the ones about to finish) plus a
    window of BATCH more that rotates over the rest, so a receive that completes out of order
    is still seen within n / BATCH polls. Finished entries are skipped from the front and the
    list is compacted once they are half of it, so a poll costs O(BATCH) amortised. Batch
    sizes measured (2 ranks, ``overlap bench ops --backend mpi --concurrent 2000,10000``,
    overlap/raw): 4: 3.3x / 1.50x, 8: 4.2x / 1.39x, 16: 5.2x / 1.82x, 32: 5.6x / 1.87x,
    64: 9.8x / 2.6x (MPICH's Testsome cost grows with the requests it is given).
    """

    def __init__(self) -> None:
        self._pending: list[MpiOp] = []
        self._head = 0  # entries before it are finished
        self._cursor = 0  # the rotating window's start
        self._last_progress = time.monotonic()
        self._delay = 0.0

    def has_pending(self) -> bool:
        return self._head < len(self._pending)

    def _window(self) -> list[int]:
        """Indices to test this poll: the BATCH oldest pending, then the rotating window."""
        p = self._pending
        h, n = self._head, len(p)
        while h < n and p[h]._state is not PENDING:
            h += 1
        self._head = h
        if h >= 1024 and h * 2 >= n:  # compact: drop the finished entries in front
            self._pending = p = [e for e in p[h:] if e._state is PENDING]
            self._head = h = 0
            self._cursor = 0
            n = len(p)
        front_end = min(h + BATCH, n)
        idx = list(range(h, front_end))
        if front_end < n:
            c = self._cursor if front_end <= self._cursor < n else front_end
            end = min(c + BATCH, n)
            idx.extend(range(c, end))
            self._cursor = end if end < n else front_end
        return idx

    @staticmethod
    def _test_held(held: list[MpiOp]) -> bool:
        """Test ``held`` once (their locks held): complete what finished, expire what is
        overdue; True if any handle finished.

        Ops that read their Status at completion (a receive's sender and size, a post) are
        tested one by one, each into a Status kept on the op before the call: a
        KeyboardInterrupt raised after MPI completed (and freed) the request and before the
        op completed then leaves the op pending with its filled Status, which the next
        test or wait completes it with (``_freed``). One ``Testsome`` over them filled a
        list that such an interrupt lost (CPython checks for signals after the call returns,
        before its result is stored), and the receive could only fail. The others (sends,
        collectives) share one ``Testsome`` with no Statuses."""
        MPI = held[0].MPI
        progressed = False
        batch: list[MpiOp] = []
        for op in held:
            if op.post is None and not op.reads_status:
                batch.append(op)
                continue
            st = op.status = MPI.Status()
            try:
                done_one = op.req.Test(st)
            except Exception as exc:
                op._fail(exc)
                progressed = True
                continue
            if done_one:
                op._complete(st)
                progressed = True
        if batch:
            try:
                done = MPI.Request.Testsome([op.req for op in batch])
            except Exception as exc:
                # Testsome reports errors for the whole batch: test one by one to place them.
                done = None
                for op in batch:
                    try:
                        if op.req.Test():
                            op._complete(None)
                    except Exception:
                        op._fail(exc)
            if done:
                progressed = True
                for k in done:
                    batch[k]._complete(None)
        for op in held:
            if op._state is PENDING and op.overdue():
                op.expire()
                progressed = True
        return progressed

    def _poll(self) -> bool:
        """Test a window of pending requests once; return True if anything completed."""
        if not self.has_pending():
            return False
        pending = self._pending
        progressed = False
        held: list[MpiOp] = []  # ops whose lock this poll holds
        live: list[MpiOp] = []
        try:
            for i in self._window():
                op = pending[i]
                if op._state is not PENDING:
                    progressed = True
                elif op.lock.acquire(blocking=False):
                    held.append(op)
                    if op._state is not PENDING:  # completed by another thread meanwhile
                        progressed = True
                    elif op.req:
                        live.append(op)
                    else:  # freed by an interrupted Test or Wait (_freed): Testsome skips
                        op._complete(op.status)  # a null request, so it would wait for ever
                        progressed = True
                # else: a thread is waiting on it right now; it stays in the list
            if live:
                progressed = self._test_held(live) or progressed
        finally:
            # Released even when a signal (a second Ctrl-C under asyncio.Runner, an
            # interrupt in a notebook) is raised on this thread mid-poll: a lock left held
            # hung every later wait() on its handle (3 runs in 8 of a SIGINT storm).
            for op in held:
                op.lock.release()
        if not self.has_pending():  # everything finished: release the list
            self._pending, self._head, self._cursor = [], 0, 0
        now = time.monotonic()
        if progressed:
            self._last_progress = now
            self._delay = 0.0
        elif now - self._last_progress > BUSY_S and not others_open(
            len(self._pending) - self._head
        ):
            self._delay = min(max(self._delay * 2, 1e-5), MAX_DELAY_S)
        return progressed


class ProgressEngine(_Poller):
    """Polls the MPI requests awaited on one event loop, on that loop's thread."""

    _engines: ClassVar[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, ProgressEngine]] = (
        weakref.WeakKeyDictionary()
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        # weakly: the registry's entry would otherwise keep its loop alive for good
        # (overlap.comm.waker says why, measured)
        self._loop = weakref.ref(loop)
        self._scheduled = False

    _last: ClassVar[tuple[Any, Any]] = (None, None)  # (weakref to loop, engine)

    @classmethod
    def for_loop(cls, loop: asyncio.AbstractEventLoop) -> ProgressEngine:
        ref, last = cls._last
        if ref is not None and ref() is loop:
            return last  # type: ignore[no-any-return]
        engine = cls._engines.get(loop)
        if engine is None:
            engine = cls._engines[loop] = cls(loop)
        cls._last = (weakref.ref(loop), engine)
        return engine

    @property
    def in_flight(self) -> int:
        """Requests still pending on this loop."""
        return sum(1 for op in self._pending[self._head :] if op._state is PENDING)

    def add(self, op: MpiOp) -> None:
        """Track ``op`` (call on the loop's thread). Resets the back-off."""
        self._pending.append(op)
        self._last_progress = time.monotonic()
        self._delay = 0.0
        if not self._scheduled:
            loop = self._loop()
            if loop is not None:  # called on the loop's thread: it is alive
                self._scheduled = True
                loop.call_soon(self._tick)

    def _tick(self) -> None:
        self._scheduled = False
        if TICK_SPIN_S and not self._delay and self.has_pending():
            # Test the oldest request (collectives complete in issue order) in a tight loop
            # for up to TICK_SPIN_S before the batch poll: MPI moves a large message only
            # inside MPI calls, a piece per call, so the rate of calls sets its speed.
            self._pending[self._head].spin(TICK_SPIN_S)
        self._poll()
        loop = self._loop()
        if self.has_pending() and loop is not None and not loop.is_closed():
            self._scheduled = True
            if self._delay:
                loop.call_later(self._delay, self._tick)
            else:
                loop.call_soon(self._tick)


class _Reaper(_Poller):
    """One daemon thread per process: completes MPI ops nobody awaits on a loop."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="overlap-mpi-reaper", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 1.0) -> None:
        """Stop polling (before MPI_Finalize: no MPI call may race with it) and join."""
        with self._lock:
            self._stop = True
        self._wake.set()
        self._thread.join(timeout)

    def add(self, op: MpiOp) -> None:
        with self._lock:
            self._pending.append(op)
            self._last_progress = time.monotonic()
            self._delay = 0.0
        self._wake.set()

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._stop:
                    return
                self._poll()
                idle = not self.has_pending()
                delay = self._delay or 5e-5
            if idle:
                self._wake.wait()
                self._wake.clear()
            else:
                time.sleep(delay)


_reaper_obj: _Reaper | None = None
_reaper_lock = threading.Lock()


def stop_reaper() -> None:
    """Stop the reaper thread if one runs: called before ``MPI_Finalize``. A reaper testing
    requests while the main thread finalizes aborted the process at exit (seen in 1 of 5
    3-rank runs of tests/mpi/run_cases.py)."""
    if _reaper_obj is not None:
        _reaper_obj.stop()


def _reaper() -> _Reaper:
    global _reaper_obj
    if _reaper_obj is None:
        with _reaper_lock:
            if _reaper_obj is None:
                _reaper_obj = _Reaper()
    return _reaper_obj
