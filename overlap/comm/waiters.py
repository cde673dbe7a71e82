"""Observe torch.distributed ``Work`` objects and complete their Handles.

Facts this module is built on (torch 2.13, gloo; DESIGN.md §3):

* ``Work.wait()`` must be called **exactly once, by one thread**: two concurrent ``wait()``
  calls on a gloo irecv leave one of them blocked forever (measured: 1 of 2 returned).
* isend, irecv, batch_isend_irecv and reduce_scatter have no future on gloo
  (``get_future()`` raises) and ``is_completed()`` stays False until ``wait()`` runs, so
  someone has to call ``wait()``.
* Blocking inside a torch future callback deadlocks gloo's two worker threads.
* On NCCL, ``Work.wait()`` does not block the host: it makes the *calling thread's current
  CUDA stream* wait for the collective. A waiter thread's current stream is the device's
  default stream, so a Work issued from another stream (the scheduler's side stream, a user's
  ``torch.cuda.stream(s)`` block) is waited for under the stream that was current when it was
  issued: the result is then ordered on the stream that asked for it (DESIGN.md contract 4).

So a Work with no future (or with post-processing: the average's division, restoring a
``reduce``'s non-destination tensor) is handed to a pool of waiter threads; a thread calls
``wait()`` (which releases the GIL), post-processes, and completes the Handle, which wakes
the awaiting loops through their wakers (overlap/comm/waker.py).

Works that have a future and nothing to do after them complete from the future's callback
instead (no thread at all; see :class:`TorchOp`). An op awaited on an idle loop is first
polled on the loop's own thread for up to 300 us (``OVERLAP_GLOO_SPIN_US``), so a small one
completes with no wake-up (:func:`spin_until`); one of more bytes than the window could see
move (:data:`SPIN_BYTES`) is not polled. The pool grows on demand with no cap and
keeps a few idle threads, so the thread count is stable in a steady training loop.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from overlap.comm import claims as _claims
from overlap.comm import inflight as _inflight
from overlap.comm import interruptible as _interruptible
from overlap.comm import knobs as _knobs
from overlap.comm import quiesce as _quiesce
from overlap.comm import spin as _spin
from overlap.comm import state as _state
from overlap.comm.handle import PENDING, Handle
from overlap.errors import CommError

__all__ = [
    "TorchOp",
    "WaiterPool",
    "fail_in_flight",
    "poll_first",
    "spin_until",
    "start_together",
    "translate_error",
]

log = logging.getLogger(__name__)

PostFn = Callable[[], object]
_Item = tuple["TorchOp", Handle]
_YIELD = getattr(os, "sched_yield", lambda: time.sleep(0))  # releases the GIL either way
SPIN_S = _knobs.number("OVERLAP_GLOO_SPIN_US", 300, low=0, high=1e5, unit="microseconds") * 1e-6
# An op of more bytes than this cannot complete within the spin window (8 GB/s, twice what
# gloo's loopback moves here, 2.4 MB in the default 300 us): it is not polled (spin_until).
SPIN_BYTES = SPIN_S * 8e9


def translate_error(exc: BaseException, handle: Handle, rank: int) -> BaseException:
    """Wrap a backend error in CommError (backend error as ``__cause__``)."""
    if isinstance(exc, CommError):
        return exc
    err = CommError(f"{handle.op} on rank {rank} (group {handle.group}) failed: {exc}")
    err.__cause__ = exc
    return err


def _on_stream(stream: Any) -> Any:
    import torch

    return torch.cuda.stream(stream)


def observe(
    work: Any,
    handle: Handle,
    post: PostFn | None,
    rank: int,
    stream: Any = None,
    sliced: bool = False,
) -> None:
    """Wait for ``work`` (blocking; on NCCL: order it on ``stream``), post-process, complete
    ``handle``. Raises nothing but a KeyboardInterrupt or SystemExit that a signal raised
    here (a ``h.wait()`` on the main thread, Ctrl-C), which goes on to the caller: the
    handle completes if the Work says it has and there is no post-processing (the signal
    lands once ``Work.wait()`` has returned), else it fails with a CommError saying it was
    interrupted (the post-processing may have run in part). Before, the interrupt was
    wrapped in a CommError with an empty message and the Ctrl-C was lost. ``sliced``: a
    gloo collective, waited for in slices on the main thread so that the signal lands
    while the op runs (overlap.comm.interruptible); where it lands before the op has
    completed, the handle stays pending, untouched, for a later wait or await to observe
    (the caller gives the Work back: :meth:`TorchOp.wait`). The caller has registered the
    observation for the exit hook (``_quiesce.begin``); this ends it."""
    interrupted: BaseException | None = None
    try:
        err: BaseException | None = None
        resumable = False
        try:
            if stream is None:  # gloo: no context to enter (a nullcontext cost 0.3 us a wait)
                _wait_and_post(work, post, sliced)
            else:
                with _on_stream(stream):
                    _wait_and_post(work, post, sliced)
        except (KeyboardInterrupt, SystemExit) as exc:
            interrupted = exc
            if sliced and not _ended(work):
                resumable = True  # between two slices: the op runs on, untouched
            elif post is None and _completed(work):
                err = None  # the signal landed once wait() had returned: the op is done
            else:
                err = CommError(
                    f"{handle.op} on rank {rank} (group {handle.group}) was interrupted "
                    f"({type(exc).__name__}) while this thread waited for it: whether it "
                    "completed is unknown, so its result must not be used"
                )
                err.__cause__ = exc
        except BaseException as exc:
            err = translate_error(exc, handle, rank)
        if not resumable:
            _inflight.untrack(handle)
            handle._finish(err)
    finally:
        _quiesce.end(handle)
    if interrupted is not None:
        raise interrupted


def _wait_and_post(work: Any, post: PostFn | None, sliced: bool) -> None:
    _interruptible.wait(work, sliced)
    if post is not None:
        post()


def _ended(work: Any) -> bool:
    """Whether ``work`` has ended, either way; True where it cannot say."""
    try:
        return bool(work.is_completed())
    except Exception:
        return True


def _completed(work: Any) -> bool:
    """Whether ``work`` has completed without an error. A collective's future says so;
    ``Work.is_success()`` (deprecated in torch, which prints a warning asking to report its
    use: every Ctrl-C of the demo printed it) only where there is no future (gloo's p2p)."""
    try:
        if not work.is_completed():
            return False
    except Exception:
        return False
    try:
        fut = _future_of(work)
    except Exception:  # a pair of p2p works (overlap.comm.exchange) has none
        fut = None
    if fut is not None:
        try:
            fut.value()
        except Exception:
            return False
        return True
    try:
        return bool(work.is_success())
    except Exception:
        return False


class TorchOp:
    """The torch Work behind one Handle, and that Handle's completion engine.

    Ownership is lazy and claimed once: the first of these takes the Work, and nobody else
    ever calls its ``wait()``:

    * ``h.wait()`` with no timeout waits on the caller's thread, as fast as a blocking call;
    * ``await h``, ``h.wait(timeout)``, ``h.done()``, ``add_done_callback`` or dropping the
      handle observe it asynchronously: a Work with a future and nothing to do after it
      (gloo collectives other than an average or a non-destination ``reduce``) completes
      its Handle from the future's callback, on gloo's own thread, with no thread hop
      (measured: an awaited 4-byte all_reduce went from 1.83x to 1.41x torch's blocking
      call); everything else (p2p and reduce_scatter have no future on gloo; NCCL orders
      the result on a stream; post-processing must not run on gloo's thread) goes to the
      waiter pool.

    An op of a job that was destroyed since it was issued fails with CommError.
    """

    __slots__ = ("_claimed", "_taken", "future", "gen", "post", "rank", "sliced", "stream", "work")

    def __init__(
        self,
        work: Any,
        post: PostFn | None,
        rank: int,
        stream: Any = None,
        future: bool = False,
    ) -> None:
        self.work = work
        self.post = post
        self.rank = rank
        self.stream = stream  # NCCL: the CUDA stream current at issue, None otherwise
        self.future = future and post is None and stream is None
        # a gloo collective (p2p has no future): a blocking wait in slices, for Ctrl-C
        self.sliced = future and stream is None
        self.gen = _state.generation
        # Two atomic test-and-set flags: a lock is held once its flag is set
        self._claimed = threading.Lock()  # someone hands the Work off (can be given back)
        self._taken = threading.Lock()  # a thread observes the Work (for good)

    def _claim(self) -> bool:
        return self._claimed.acquire(blocking=False)

    def _stale(self, handle: Handle) -> bool:
        if self.gen == _state.generation:
            return False
        handle._finish(_inflight.destroyed_error(handle))
        return True

    def start(self, handle: Handle) -> None:
        if self._stale(handle) or not self._claim():
            return
        try:
            self._hand_off(handle)
        except BaseException:
            self._unclaim(handle)
            raise

    def _unclaim(self, handle: Handle) -> None:
        """A signal (Ctrl-C in a notebook, a second one under asyncio.Runner) was raised on
        this thread between the claim and the hand-off: give the claim back, so the next
        ``wait()`` or ``await`` hands the Work off again. Before, the handle stayed pending
        for good (a SIGINT storm over 16 awaited receives left 2 pending in 1 round of 9).
        A hand-off that had taken is harmless to repeat: the future's callback completes
        the handle idempotently and a pool thread observes the Work only once (``_take``)."""
        if handle._state is PENDING:
            self._claimed.release()

    def _take(self) -> bool:
        """The one observation of the Work: only its first caller may call ``wait()``."""
        return self._taken.acquire(blocking=False)

    def _hand_off(self, handle: Handle) -> None:
        _inflight.track(handle)
        # Registered before the observation can start, ended by its last Python line: exit
        # waits for it (overlap/comm/quiesce.py).
        _quiesce.begin(handle)
        if self.future:
            fut = _future_of(self.work)
            if fut is not None:
                rank = self.rank

                def done(f: Any) -> None:
                    # On gloo's thread, the future complete: value() returns (or raises)
                    # at once, without releasing the GIL.
                    _inflight.untrack(handle)
                    try:
                        f.value()
                    except BaseException as exc:
                        handle._finish(translate_error(exc, handle, rank))
                    else:
                        handle._finish(None)
                    finally:
                        _quiesce.end(handle)

                fut.add_done_callback(done)
                return
        try:
            get_pool().submit(self, handle)
        except BaseException:
            _quiesce.end(handle)
            raise

    def observe_once(self, handle: Handle) -> bool:
        """Observe the Work (see :func:`observe`) unless another thread already does;
        False if one does."""
        if not self._take():
            return False
        observe(self.work, handle, self.post, self.rank, self.stream, self.sliced)
        return True

    def wait(self, handle: Handle, timeout: float | None) -> bool:
        # _stale, _claim and observe_once written out: this is every blocking call's path
        if self.gen != _state.generation and self._stale(handle):
            return True
        if timeout is None and self._claimed.acquire(blocking=False):
            try:
                _quiesce.begin(handle)
                if self._taken.acquire(blocking=False):
                    try:
                        if self.sliced:
                            poll_first(self.work, handle.nbytes)
                        observe(self.work, handle, self.post, self.rank, self.stream, self.sliced)
                    except BaseException:
                        if handle._state is PENDING:  # interrupted while the op runs on:
                            self._taken.release()  # the next wait or await observes it
                        raise
                else:  # a pool thread took it before an interrupt
                    handle._block_until_done(None)
            except BaseException:
                self._unclaim(handle)
                raise
            return True
        self.start(handle)
        return handle._block_until_done(timeout)

    def on_await(self, handle: Handle, loop: Any) -> None:
        # An idle loop (nothing else of this process observed asynchronously) first waits
        # for the op on its own thread, for up to SPIN_S (see spin_until). An op awaited
        # while another is still being observed (the later handles of a gather whose first
        # op is in flight) goes straight to its engine; the ops of one collect_all share
        # one window (overlap.comm.spin).
        seconds = 0.0
        if (
            SPIN_S > 0
            and self.stream is None
            and handle.nbytes <= SPIN_BYTES
            and not _inflight.busy()
        ):
            seconds = _spin.window(SPIN_S)
        if seconds and self.future:
            # The Work is polled before any callback exists: gloo's thread then completes
            # the op without taking the GIL, and start() below finds the future done and
            # runs the callback right here.
            spin_until(self.work.is_completed, seconds)
        self.start(handle)
        if seconds and not self.future and handle._state is PENDING:
            # p2p and reduce_scatter have no future and is_completed() stays False until
            # wait(): a pool thread waits, and the loop polls the handle meanwhile.
            spin_until(lambda: handle._state is not PENDING, seconds)


def start_together(handles: list[Handle]) -> None:
    """Hand off every op of one awaited ``collect_all`` before the loop spins on any, when
    they are all gloo ops with no future (isend, irecv, reduce_scatter: a pool thread must
    sit in each one's ``wait()``) and at least two are pending on an idle loop; then spin on
    their states for the (shared) window, as :meth:`TorchOp.on_await` does for one op.
    Anything else, or no window left: nothing here, each op is observed by its own
    :meth:`TorchOp.on_await`.

    Why: ``collect_all`` observes its handles one after another, and an op with no future
    was spun on alone before the next one was handed off, so the pair of an awaited
    sendrecv paid two thread hand-offs in series (the send's began when the receive had
    completed). Handed off together, the waiter threads wake while the loop spins: awaited
    gloo sendrecv 1.79-1.98x torch's ``irecv`` + ``isend`` + waits -> 1.45-1.64x at 4
    bytes, 1.28-1.38x -> 1.13-1.20x at 1 MiB (docs/architecture.md, "An awaited pair's
    hand-offs together"). A mixed batch (an op with a future among them) keeps the
    one-by-one path, whose first op spins with no thread at all. A batch with an op too
    large to complete within a window (:data:`SPIN_BYTES`) is handed off together, with no
    spin."""
    ops = [h for h in handles if h._state is PENDING]
    if len(ops) < 2 or SPIN_S <= 0 or _inflight.busy():
        return
    for h in ops:
        e = h._engine
        if type(e) is not TorchOp or e.future or e.stream is not None:
            return
    if any(h.nbytes > SPIN_BYTES for h in ops):
        # one of them cannot complete within a window (SPIN_BYTES): handed off together
        # all the same, with no spin
        for h in ops:
            h._engine.start(h)
        return
    seconds = _spin.window(SPIN_S)
    if not seconds:
        return
    for h in ops:
        h._engine.start(h)
    spin_until(lambda: all(h._state is not PENDING for h in ops), seconds)


def spin_until(done: Callable[[], bool], seconds: float) -> None:
    """Poll ``done()`` for up to ``seconds`` (``SPIN_S``: ``OVERLAP_GLOO_SPIN_US``, default
    300 us; less where a collect_all's ops share one window, overlap.comm.spin), yielding the
    CPU between polls.

    Why: an awaited op that completes from gloo's thread costs a wake-up of the loop (it
    sleeps in epoll; gloo's thread writes its eventfd) where torch's blocking call is
    woken by gloo directly: an awaited 4-byte all_reduce took 1.41-1.47x torch's blocking
    call, the floor of any callback path (docs/architecture.md). Polling on the loop's
    thread completes a small op with no wake-up at all: 0.9-1.0x (2 ranks, side by side).
    ``os.sched_yield`` releases the GIL and lets gloo's threads run where there are fewer
    cores than threads; polling without it made the same op slower the longer it polled
    (1.6x at no spin, 2.1x at 100 us, 3.2x at 300 us; with it 1.23x and 1.12x). Bounded,
    so the loop is never held longer than a short callback, as MPI's spin
    (overlap.comm.progress); an interrupt here loses nothing, as nothing is claimed.

    A blocking gloo collective and ``h.wait()`` poll the same way before they sleep in
    ``Work.wait()`` (:func:`poll_first`): gloo's condition variable then never has to wake
    them for a small op. Measured, ``overlap bench ops`` at 4 bytes, 2 ranks, two runs
    with and without: blocking all_reduce 0.85-0.88x torch's (1.00-1.03x without),
    broadcast 0.84-0.95x (1.04-1.14x without).
    """
    clock, pause = time.perf_counter, _YIELD
    deadline = clock() + seconds
    try:
        while not done() and clock() < deadline:
            pause()
    except Exception:  # a Work that cannot say: its engine completes the handle anyway
        return


def poll_first(work: Any, nbytes: int = 0) -> None:
    """Before a blocking wait on a gloo collective's Work (one with a future, whose
    ``is_completed()`` turns True on its own): poll it as :func:`spin_until` does, so that a
    small op completes with no sleep on gloo's condition variable and no wake-up. Not on
    overlap's own threads (a bucket worker, a steps driver: they wait while the training
    thread computes, and polling would take its core), nor while another op of the process
    is observed asynchronously (its threads need the cores). Used by a blocking collective
    (``TorchBackend._launch``) and by ``h.wait()`` (:meth:`TorchOp.wait`)."""
    if nbytes <= SPIN_BYTES and not _inflight.busy() and not _claims.on_internal_thread():
        spin_until(work.is_completed, SPIN_S)


class WaiterPool:
    """Threads that call ``Work.wait()`` and complete Handles. One pool per process.

    A Work without a future can only be observed by a thread blocked in its ``wait()``, so
    the pool has no cap: every submitted Work gets a thread as soon as none is idle (a cap
    deadlocked 40 outstanding irecvs awaited before the sends they depended on). Threads
    beyond ``keep_threads`` exit after ``idle_s`` seconds without work.
    """

    def __init__(self, keep_threads: int = 4, idle_s: float = 10.0) -> None:
        self.keep_threads = keep_threads
        self.idle_s = idle_s
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._outstanding = 0
        self._closed = False
        self._serial = 0

    @property
    def num_threads(self) -> int:
        return len(self._threads)

    @property
    def outstanding(self) -> int:
        """Works submitted whose ``wait()`` has not returned yet: 0 once every op a pool
        thread observes has completed (a thread stuck on a Work keeps it above 0)."""
        return self._outstanding

    def submit(self, op: TorchOp, handle: Handle) -> None:
        """Arrange for ``handle`` to complete when ``op``'s Work does. Non-blocking."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the communication backend was shut down")
            self._outstanding += 1
            if self._outstanding > len(self._threads):
                self._spawn()
        self._queue.put((op, handle))

    def _spawn(self) -> None:
        self._serial += 1
        t = threading.Thread(target=self._run, name=f"overlap-waiter-{self._serial}", daemon=True)
        self._threads.append(t)
        t.start()

    def _run(self) -> None:
        q = self._queue
        me = threading.current_thread()
        while True:
            try:
                item = q.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    if len(self._threads) > self.keep_threads and self._outstanding < len(
                        self._threads
                    ):
                        self._threads.remove(me)
                        return
                continue
            if item is None:
                return
            try:
                item[0].observe_once(item[1])
            finally:
                with self._lock:
                    self._outstanding -= 1

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop idle threads. Threads still blocked on a Work are daemons and are left behind."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._queue.put(None)
        for t in threads:
            t.join(timeout=timeout / max(len(threads), 1))
            if t.is_alive():
                log.warning("%s is still waiting on an op at shutdown", t.name)


def _future_of(work: Any) -> Any:
    try:
        return work.get_future()
    except RuntimeError:
        return None


_pool: WaiterPool | None = None
_pool_lock = threading.Lock()


def get_pool() -> WaiterPool:
    """The process's waiter pool, created on first use (and anew in a forked child)."""
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = WaiterPool()
    return _pool


def fail_in_flight() -> int:
    """Fail every asynchronously observed handle still in flight (destroy_process_group)."""
    return _inflight.fail_all()


def reset_pool() -> None:
    """Shut the pool down; the next ``get_pool()`` makes a fresh one."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.shutdown()


def _after_fork_in_child() -> None:
    global _pool, _pool_lock
    _pool = None  # the parent's threads do not exist here
    _pool_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
