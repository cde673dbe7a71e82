"""Tracer: spans from every layer, cheap enough to leave on.

A span is one tuple appended to a list: ``(name, cat, start_ns, end_ns, tid, args)`` on the
``time.perf_counter_ns`` clock (monotonic). ``list.append`` is atomic under the GIL, so
recording needs no lock and any thread may record. Categories the report understands:

* ``comm``: one communication op (args: op, bytes, group, backend, world);
* ``compute``: work the communication can hide behind (backward, user compute spans);
* ``bucket``: a bucket's reduction in the scheduler (args: bucket, bytes, flow id);
* ``wait``: time the user was blocked waiting for communication (synchronize / await);
* ``step``: a training step boundary; ``user``: anything else.

The comm layer and the scheduler record only when a tracer is attached
(``tracer.attach()`` or ``with tracer:``); without one the cost is a single global lookup.
When ``torch.profiler`` is running, :meth:`Tracer.span` also opens a ``record_function``
range, so user spans appear in the profiler's trace beside the kernels.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["Span", "Tracer", "current"]

Span = tuple[str, str, int, int, int, dict[str, Any]]

_current: Tracer | None = None


def current() -> Tracer | None:
    """The attached tracer, or None (the hot-path check)."""
    return _current


class Tracer:
    """Records spans; exports Chrome/Perfetto JSON; computes the overlap report."""

    def __init__(self, *, name: str = "overlap") -> None:
        self.name = name
        self.spans: list[Span] = []
        self.thread_names: dict[int, str] = {}
        self.rank = 0
        self.world = 1
        self._flow = 0

    # --------------------------------------------------------------------- attachment
    def attach(self) -> Tracer:
        """Make this the tracer the comm layer and schedulers record into."""
        global _current
        _current = self
        try:
            from overlap import comm

            if comm.is_initialized():
                self.rank, self.world = comm.get_rank(), comm.get_world_size()
        except Exception:  # pragma: no cover - tracing must never break the caller
            pass
        return self

    def detach(self) -> None:
        global _current
        if _current is self:
            _current = None

    def __enter__(self) -> Tracer:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # ---------------------------------------------------------------------- recording
    def record(self, name: str, cat: str, start_ns: int, end_ns: int, **args: Any) -> None:
        """Append one span (any thread)."""
        tid = threading.get_ident()
        if tid not in self.thread_names:
            self.thread_names[tid] = threading.current_thread().name
        self.spans.append((name, cat, start_ns, end_ns, tid, args))

    def instant(self, name: str, cat: str = "user", **args: Any) -> None:
        t = time.perf_counter_ns()
        self.record(name, cat, t, t, **args)

    def next_flow(self) -> int:
        self._flow += 1
        return self._flow

    @contextlib.contextmanager
    def span(self, name: str, cat: str = "compute", **args: Any) -> Iterator[None]:
        """``with tracer.span("forward"):`` records the block (category compute by default)."""
        rf: Any = None
        try:
            import torch

            if torch.autograd.profiler._is_profiler_enabled:
                rf = torch.profiler.record_function(name)
                rf.__enter__()
        except Exception:  # pragma: no cover
            rf = None
        t0 = time.perf_counter_ns()
        try:
            yield
        finally:
            self.record(name, cat, t0, time.perf_counter_ns(), **args)
            if rf is not None:
                rf.__exit__(None, None, None)

    def step(self) -> None:
        """Mark a step boundary (the report splits per step at these marks)."""
        self.instant("step", "step")

    def clear(self) -> None:
        self.spans.clear()

    # ------------------------------------------------------------------------ outputs
    def report(self) -> Any:
        """The :class:`~overlap.trace.report.OverlapReport` of what was recorded."""
        from overlap.trace.report import OverlapReport

        return OverlapReport.from_spans(self.spans, world=self.world)

    def export_chrome(self, path: str) -> str | None:
        """Write a Chrome/Perfetto trace. In a job, every rank calls it; rank 0 writes one
        merged file with the ranks' clocks aligned. Returns the path on the writing rank."""
        from overlap.trace.chrome import export

        return export(self, path)
