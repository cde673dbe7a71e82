"""Where a bucket's compression and collective run: off the autograd thread.

* CPU: one worker thread runs the buckets' reductions while backward goes on; torch ops and
  the codec kernels release the GIL, so both make progress. Reductions are steps generators
  (:mod:`overlap.comm.steps`), *pipelined* by a fixed rule: when bucket k arrives, the worker
  starts it (its first phase: compress, issue phase 1), then advances every older bucket in
  flight by exactly one phase, oldest first. So bucket k is compressed while bucket k-1's
  phase 1 is on the wire, and bucket k-1's phase 2 is issued right after bucket k's phase 1.
  ``flush()`` (the end of the step) drives everything left to the end, in the same order.
  The issue order depends only on the order buckets arrive in (bucket-index order), never on
  timing, so every rank issues the same collectives in the same order (DESIGN.md contract 1).
* CUDA (DESIGN.md contract 8): the same worker thread runs each reduction under a side stream
  that first waits on an event recorded on the compute stream after the bucket's last
  gradient; the bucket buffer is marked with ``record_stream`` for the side stream; a
  completion event is recorded there, and ``wait_compute()`` makes the compute stream wait on
  it before anything reads the gradients.

**Out of step.** A reduction that fails with an error of this rank's own (not a
``NonFiniteError``, which the Compressor contract raises on every rank at the same phase)
issued fewer collectives than its peers' reductions do; one whose collective failed
(``CommError``: a peer lost or timed out) leaves peers that may never issue the rest. If
the worker went on with the other buckets, their collectives would pair with different ops
on the peers (gloo matches by issue count): data summed across the wrong buckets, returned
as a normal result, or a size mismatch that aborts the process. So the launcher *stops*:
the buckets in flight end with :class:`~overlap.errors.OutOfStepError` after the phase
they are in, and nothing is issued again (:attr:`Launcher.broken`). What this rank did
issue is a prefix of what its peers issue, so nothing can pair wrongly: a peer's next
collective waits until the backend's timeout, fails with CommError, and stops that peer
the same way; or, where the error came before this rank cast the step's vote, the vote
carries a bit that says so, and each peer stops at once (``BucketScheduler``'s end of step).

The completion event is recorded *before* the bucket's handle is finished. The order matters:
``synchronize()`` calls ``wait_compute()`` once every handle is done, and a CUDA stream that
waits on an event not yet recorded does not wait at all, so finishing first would let the
compute stream read a bucket that the side stream is still writing (tests/gpu proves the
wait with a delayed side-stream kernel).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from overlap.comm import claims as _claims
from overlap.comm import quiesce as _quiesce
from overlap.comm.handle import Handle
from overlap.comm.steps import Steps, in_step, run
from overlap.errors import CommError, OutOfStepError

__all__ = ["Launcher"]

_FLUSH = object()

log = logging.getLogger(__name__)

Job = Callable[[], None]
Finish = Callable[[BaseException | None], None]


def _attempt(job: Job) -> BaseException | None:
    """Run ``job``; its error, or None."""
    try:
        job()
    except BaseException as exc:
        return exc
    return None


class _InFlight:
    """One reduction in the CPU pipeline: its generator and the handles it waits for."""

    __slots__ = ("failed", "finish", "pending", "steps")

    def __init__(
        self, steps: Steps, finish: Finish, failed: Callable[[BaseException], None]
    ) -> None:
        self.steps = steps
        self.finish = finish
        # called with the reduction's error before ``finish`` (Launcher.failed): whoever sees
        # the bucket fail then sees the launcher stopped too
        self.failed = failed
        self.pending: list[Any] = []

    def start(self) -> bool:
        """Run the first phase; True while phases remain."""
        return self._step(lambda: next(self.steps))

    def advance(self, stopped: Callable[[], OutOfStepError | None]) -> bool:
        """Wait for this phase's handles, run the next phase; True while phases remain. A
        failed handle is thrown into the generator, as :func:`overlap.comm.steps.run` does.
        If ``stopped()`` says the launcher stopped meanwhile (a peer out of step, learned on
        the main thread), end instead of issuing the next phase."""
        for h in self.pending:
            try:
                h.wait()
            except BaseException as exc:
                return self._step(functools.partial(self.steps.throw, exc))
        err = stopped()
        if err is not None:
            self.abandon(err)
            return False
        return self._step(lambda: self.steps.send(None))

    def abandon(self, err: BaseException) -> None:
        """End without issuing anything more: close the generator, finish with ``err``.

        What it issued is not waited for. On a peer of the rank that stopped, an op past
        the point where that rank stopped never completes: it fails at the backend's
        timeout, and gloo runs a group's ops in turn, so waiting for each would take a
        timeout apiece. Such an op writes only into the reduction's own buffers (its
        handle keeps them alive), never into ``.grad``: nothing is copied back once
        stopped."""
        self.pending = []
        self.steps.close()
        self.finish(err)

    def _step(self, fn: Callable[[], list[Any]]) -> bool:
        try:
            self.pending = fn()
            return True
        except StopIteration:
            self.finish(None)
        except BaseException as exc:
            self.steps.close()
            self.failed(exc)
            self.finish(exc)
        return False


class Launcher:
    """A single worker thread (and, on CUDA, a side stream) that runs bucket reductions."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream: Any = (
            torch.cuda.Stream(device=device) if self.cuda else None  # type: ignore[no-untyped-call]
        )
        self._events: list[Any] = []
        self._events_lock = threading.Lock()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # Set once, never cleared: the error that every reduction submitted from now on ends
        # with, unissued (see the module docstring, "Out of step").
        self.broken: OutOfStepError | None = None
        # The error of this rank's own that put it out of step (None when a peer's did).
        self.origin: BaseException | None = None
        self._stop_lock = threading.Lock()
        # CPU seconds the worker thread has used, as of the last queue item it finished
        # (written by the worker only): what compression and the copies cost a step.
        self.cpu_s = 0.0
        self._thread = threading.Thread(target=self._run, name="overlap-bucket-worker", daemon=True)
        self._thread.start()

    def failed(self, exc: BaseException) -> None:
        """A reduction failed with ``exc``: stop unless every rank raises it alike
        (:func:`overlap.comm.steps.in_step`)."""
        if not in_step(exc):
            self.stop_for(exc)

    def stop_for(self, exc: BaseException) -> None:
        """Stop: a reduction (or the scheduler's vote) failed with ``exc``, which leaves
        this rank out of step with its peers. The first call wins; logged once."""
        with self._stop_lock:
            if self.broken is not None:
                return
            level = logging.ERROR
            if isinstance(exc, CommError):
                why = f"a collective of the scheduler's failed ({type(exc).__name__}: {exc})"
            elif isinstance(exc, (KeyboardInterrupt, SystemExit)):
                level = logging.WARNING  # the user's own doing, not a fault
                why = (
                    f"the end of a step was interrupted on this rank ({type(exc).__name__}), "
                    "somewhere among its collectives"
                )
            else:
                why = (
                    "a bucket's reduction raised an error on this rank only "
                    f"({type(exc).__name__}: {exc})"
                )
            if _quiesce.tearing_down():  # the program ended with this step in flight
                level = logging.DEBUG
            log.log(level, "%s; the scheduler issues no more collectives", why)
            self.origin = exc  # before ``broken``: whoever sees broken sees its origin
            self.broken = OutOfStepError(
                f"this BucketScheduler stopped issuing collectives: {why}, so this rank's "
                "collectives no longer match its peers' (any further one could pair with a "
                "different op on them). Create new process groups and a new BucketScheduler "
                "to go on (e.g. restart the job from a checkpoint)"
            )

    def submit_steps(self, steps: Steps, finish: Finish, flat: torch.Tensor) -> None:
        """Run a reduction written as a steps generator, then ``finish(error or None)``.

        CPU: pipelined with the other buckets (see the module docstring); call
        :meth:`flush` once the step's last bucket is submitted. CUDA: run to the end on the
        side stream, one bucket after the other, after the compute stream's current work;
        its completion event is recorded before ``finish`` is called."""
        if not self.cuda:
            self._queue.put(_InFlight(steps, finish, self.failed))
            return

        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record(torch.cuda.current_stream(self.device))
        # The bucket was allocated on the compute stream and is used on the side stream: tell
        # the caching allocator, so its memory is not handed out again (when the bucket is
        # freed, e.g. at a rebuild) before the side stream's work on it is done.
        flat.record_stream(self.stream)
        stream = self.stream

        def on_stream() -> None:
            if self.broken is not None:
                steps.close()
                finish(self.broken)
                return
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                err = _attempt(lambda: run(steps))
                done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                done.record(stream)
            with self._events_lock:
                self._events.append(done)
            if err is not None:
                self.failed(err)
            finish(err)

        self._queue.put(on_stream)

    def flush(self) -> None:
        """Drive every submitted reduction to the end (the step's buckets are all in)."""
        if not self.cuda:
            self._queue.put(_FLUSH)

    def drained(self) -> Handle:
        """Flush, and a handle that completes once the worker has handled everything
        submitted so far: once stopped, every reduction has ended (its generator closed, so
        a hierarchical bucket's shared-memory file is gone) without issuing more."""
        self.flush()
        h = Handle("drained", result=None)
        self._queue.put(lambda: h._finish(None))
        return h

    def wait_compute(self) -> None:
        """Make the compute stream wait for every finished reduction (CUDA; no-op on CPU)."""
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            with self._events_lock:
                events, self._events = self._events, []
            for ev in events:
                cur.wait_event(ev)

    def _advance(self, inflight: deque[_InFlight], items: list[_InFlight]) -> None:
        """Advance each of ``items`` by one phase, in order; drop the finished from
        ``inflight``. Once out of step, end every one instead, issuing nothing."""
        for item in items:
            if self.broken is not None:
                item.abandon(self.broken)
                inflight.remove(item)
            elif not item.advance(lambda: self.broken):
                inflight.remove(item)

    def _run(self) -> None:
        _claims.internal_thread()  # it orders its own ops (overlap.comm.claims)
        inflight: deque[_InFlight] = deque()
        while True:
            job: Any = self._queue.get()
            if job is None or job is _FLUSH:
                while inflight:  # oldest first, one phase each per round: a fixed order
                    self._advance(inflight, list(inflight))
                if job is None:
                    return
            elif isinstance(job, _InFlight):
                older = list(inflight)
                if self.broken is not None:
                    job.abandon(self.broken)
                elif job.start():
                    inflight.append(job)
                self._advance(inflight, older)
            else:
                job()
            # Drop the closure now, not at the next get(): it holds the bucket, and the
            # caller may rely on the bucket's memory going back once the job is issued.
            del job
            self.cpu_s = time.thread_time()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)
