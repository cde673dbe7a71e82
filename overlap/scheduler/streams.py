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

The completion event is recorded *before* the bucket's handle is finished. The order matters:
``synchronize()`` calls ``wait_compute()`` once every handle is done, and a CUDA stream that
waits on an event not yet recorded does not wait at all, so finishing first would let the
compute stream read a bucket that the side stream is still writing (tests/gpu proves the
wait with a delayed side-stream kernel).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from overlap.comm.steps import Steps, run

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

    __slots__ = ("finish", "pending", "steps")

    def __init__(self, steps: Steps, finish: Finish) -> None:
        self.steps = steps
        self.finish = finish
        self.pending: list[Any] = []

    def start(self) -> bool:
        """Run the first phase; True while phases remain."""
        return self._step(lambda: next(self.steps))

    def advance(self) -> bool:
        """Wait for this phase's handles, run the next phase; True while phases remain. A
        failed handle is thrown into the generator, as :func:`overlap.comm.steps.run` does."""

        def nxt() -> list[Any]:
            try:
                for h in self.pending:
                    h.wait()
            except BaseException as exc:
                return self.steps.throw(exc)
            return self.steps.send(None)

        return self._step(nxt)

    def _step(self, fn: Callable[[], list[Any]]) -> bool:
        try:
            self.pending = fn()
            return True
        except StopIteration:
            self.finish(None)
        except BaseException as exc:
            self.steps.close()
            self.finish(exc)
        return False


def _advance(inflight: deque[_InFlight], items: list[_InFlight]) -> None:
    """Advance each of ``items`` by one phase, in order; drop the finished from ``inflight``."""
    for item in items:
        if not item.advance():
            inflight.remove(item)


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
        self._thread = threading.Thread(target=self._run, name="overlap-bucket-worker", daemon=True)
        self._thread.start()

    def submit(self, job: Job, finish: Finish, flat: torch.Tensor) -> None:
        """Run ``job`` on the worker, then ``finish(error or None)``.

        On CUDA the job runs on the side stream after the compute stream's current work, and
        its completion event is recorded before ``finish`` is called.
        """
        if not self.cuda:
            self._queue.put(lambda: finish(_attempt(job)))
            return

        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record(torch.cuda.current_stream(self.device))
        # The bucket was allocated on the compute stream and is used on the side stream: tell
        # the caching allocator, so its memory is not handed out again (when the bucket is
        # freed, e.g. at a rebuild) before the side stream's work on it is done.
        flat.record_stream(self.stream)
        stream = self.stream

        def on_stream() -> None:
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                err = _attempt(job)
                done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                done.record(stream)
            with self._events_lock:
                self._events.append(done)
            finish(err)

        self._queue.put(on_stream)

    def submit_steps(self, steps: Steps, finish: Finish, flat: torch.Tensor) -> None:
        """Run a reduction written as a steps generator, then ``finish(error or None)``.

        CPU: pipelined with the other buckets (see the module docstring); call
        :meth:`flush` once the step's last bucket is submitted. CUDA: run to the end on the
        side stream, one bucket after the other, as :meth:`submit`."""
        if self.cuda:
            self.submit(lambda: run(steps), finish, flat)
            return
        self._queue.put(_InFlight(steps, finish))

    def flush(self) -> None:
        """Drive every submitted reduction to the end (the step's buckets are all in)."""
        if not self.cuda:
            self._queue.put(_FLUSH)

    def wait_compute(self) -> None:
        """Make the compute stream wait for every finished reduction (CUDA; no-op on CPU)."""
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            with self._events_lock:
                events, self._events = self._events, []
            for ev in events:
                cur.wait_event(ev)

    def _run(self) -> None:
        inflight: deque[_InFlight] = deque()
        while True:
            job: Any = self._queue.get()
            if job is None or job is _FLUSH:
                while inflight:  # oldest first, one phase each per round: a fixed order
                    _advance(inflight, list(inflight))
                if job is None:
                    return
            elif isinstance(job, _InFlight):
                older = list(inflight)
                if job.start():
                    inflight.append(job)
                _advance(inflight, older)
            else:
                job()
            # Drop the closure now, not at the next get(): it holds the bucket, and the
            # caller may rely on the bucket's memory going back once the job is issued.
            del job

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)
