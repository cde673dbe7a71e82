"""Where a bucket's compression and collective run: off the autograd thread.

* CPU: one worker thread runs the buckets' reductions in FIFO order (so collectives are issued
  in bucket-index order, DESIGN.md contract 1) while backward goes on; torch ops release the
  GIL, so both make progress.
* CUDA (DESIGN.md contract 8): the same worker thread runs each reduction under a side stream
  that first waits on an event recorded on the compute stream after the bucket's last
  gradient; the bucket buffer is marked with ``record_stream`` for the side stream; a
  completion event is recorded there, and ``wait_compute()`` makes the compute stream wait on
  it before anything reads the gradients.
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


class Launcher:
    """A single worker thread (and, on CUDA, a side stream) that runs bucket reductions."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream: Any = (
            torch.cuda.Stream(device=device) if self.cuda else None  # type: ignore[no-untyped-call]
        )
        self._events: list[Any] = []
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="overlap-bucket-worker", daemon=True)
        self._thread.start()

    def submit(self, job: Job, flat: torch.Tensor) -> None:
        """Run ``job`` on the worker (after the compute stream's current work, on CUDA)."""
        if self.cuda:
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record(torch.cuda.current_stream(self.device))
            flat.record_stream(self.stream)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._events.append(done)

            def on_stream() -> None:
                with torch.cuda.stream(self.stream):
                    self.stream.wait_event(ready)
                    job()
                    done.record(self.stream)

            self._queue.put(on_stream)
        else:
            self._queue.put(job)

    def wait_compute(self) -> None:
        """Make the compute stream wait for every submitted reduction (CUDA; no-op on CPU)."""
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            for ev in self._events:
                cur.wait_event(ev)
            self._events.clear()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            job()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)
