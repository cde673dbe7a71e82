"""Where a bucket's compression and collective run: off the autograd thread.

* CPU: one worker thread runs the buckets' reductions in FIFO order (so collectives are issued
  in bucket-index order, DESIGN.md contract 1) while backward goes on; torch ops release the
  GIL, so both make progress.
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
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Launcher"]

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
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
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

    def wait_compute(self) -> None:
        """Make the compute stream wait for every finished reduction (CUDA; no-op on CPU)."""
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            with self._events_lock:
                events, self._events = self._events, []
            for ev in events:
                cur.wait_event(ev)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            job()
            # Drop the closure now, not at the next get(): it holds the bucket, and the
            # caller may rely on the bucket's memory going back once the job is issued.
            del job

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)
