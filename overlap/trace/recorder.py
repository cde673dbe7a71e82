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
The comm layer reports finished ops through its observer hook (:mod:`overlap.comm.hooks`),
which ``attach()`` points at this tracer: comm never imports this package.
When ``torch.profiler`` is running, :meth:`Tracer.span` also opens a ``record_function``
range, so user spans appear in the profiler's trace beside the kernels.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["Span", "Tracer", "current"]

Span = tuple[str, str, int, int, int, dict[str, Any]]

log = logging.getLogger(__name__)

_current: Tracer | None = None

DEFAULT_MAX_SPANS = 250_000  # about 100 MB; 41 spans a step with 4 buckets: 6,000 steps


def current() -> Tracer | None:
    """The attached tracer, or None (the hot-path check)."""
    return _current


class Tracer:
    """Records spans; exports Chrome/Perfetto JSON; computes the overlap report."""

    def __init__(self, *, name: str = "overlap", max_spans: int | None = DEFAULT_MAX_SPANS) -> None:
        """``max_spans``: keep at most this many spans, dropping the oldest first (a
        bounded memory cost for a tracer left on for a whole run; about 0.4 KB a span).
        ``None`` keeps everything. ``dropped`` counts what was dropped."""
        if max_spans is not None and (not isinstance(max_spans, int) or max_spans < 1):
            raise ValueError(f"max_spans must be a positive int or None, got {max_spans!r}")
        self.name = name
        self.max_spans = max_spans
        self.spans: collections.deque[Span] = collections.deque(maxlen=max_spans)
        self._recorded = 0
        self.thread_names: dict[int, str] = {}
        self.rank = 0
        self.world = 1
        self._flow = 0
        self._device: list[tuple[str, str, Any, Any, int, dict[str, Any]]] = []
        self._ref: tuple[Any, int] | None = None  # (CUDA event, host ns) for device time
        # schedulers and DiLoCos that attached this tracer through hold() and hold it still
        # (0: attached by the user, or not at all)
        self._holders = 0

    # --------------------------------------------------------------------- attachment
    def attach(self) -> Tracer:
        """Make this the tracer the comm layer and schedulers record into. One tracer is
        attached at a time: attaching another detaches this one, with a warning (it records
        nothing more, and its owner would otherwise not know)."""
        global _current
        from overlap.comm import hooks

        if _current is not None and _current is not self:
            log.warning(
                "Tracer %r replaces the attached Tracer %r, which records nothing more from "
                "now on (one tracer is attached at a time; detach() the first to silence this)",
                self.name,
                _current.name,
            )
        _current = self
        self._holders = 0  # attached by its user: no owner's release() detaches it
        hooks.set_observer(self._on_comm)
        try:
            from overlap import comm

            if comm.is_initialized():
                self.rank, self.world = comm.get_rank(), comm.get_world_size()
        except Exception:  # pragma: no cover - tracing must never break the caller
            pass
        return self

    def attach_if_none(self) -> Tracer:
        """Attach this tracer unless one is attached already (this one or another), so it
        records where an attached tracer leaves the comm layer's ops. Nothing detaches it
        but :meth:`detach` (an owner that will let go uses :meth:`hold`)."""
        if _current is None:
            self.attach()
        return self

    def hold(self) -> None:
        """:meth:`attach_if_none` for an owner that will :meth:`release` it (a
        BucketScheduler or DiLoCo given ``tracer=``): the tracer stays attached while any
        owner that attached it holds it, and is detached when the last one releases it.
        One the user attached stays attached. Before, a scheduler's ``remove()`` left its
        tracer attached, and the next scheduler's tracer recorded none of the comm layer's
        ops, silently."""
        if _current is None:
            self.attach()
            self._holders = 1
        elif _current is self and self._holders:
            self._holders += 1

    def release(self) -> None:
        """An owner that called :meth:`hold` is done with this tracer (its ``remove()``)."""
        if self._holders:
            self._holders -= 1
            if not self._holders:
                self.detach()

    def detach(self) -> None:
        global _current
        from overlap.comm import hooks

        self._holders = 0
        if _current is self:
            _current = None
            hooks.set_observer(None)

    def _on_comm(
        self, op: str, start_ns: int, end_ns: int, nbytes: int, group: str, backend: str, world: int
    ) -> None:
        """The comm layer's observer (overlap.comm.hooks): one ``comm`` span per op."""
        self.record(
            op,
            "comm",
            start_ns,
            end_ns,
            op=op,
            bytes=nbytes,
            group=group,
            backend=backend,
            world=world,
        )

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
        self._recorded += 1
        self.spans.append((name, cat, start_ns, end_ns, tid, args))

    @property
    def dropped(self) -> int:
        """Spans dropped so far because of ``max_spans`` (the oldest go first)."""
        return max(self._recorded - len(self.spans), 0)

    def device_span(
        self, name: str, cat: str, start_event: Any, end_event: Any, **args: Any
    ) -> None:
        """A span timed on the GPU by two CUDA events (``enable_timing=True``), already
        recorded on some stream. It is resolved later (report, export) once the events have
        completed, with ``Event.query()``: no device-wide synchronize. The GPU clock is mapped
        to the host clock through one reference event, synchronised once, here, on first use.
        """
        if self._ref is None:
            import torch

            ref = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            ref.record()
            ref.synchronize()
            self._ref = (ref, time.perf_counter_ns())
        tid = threading.get_ident()
        self.thread_names.setdefault(tid, threading.current_thread().name)
        self._device.append((name, cat, start_event, end_event, tid, args))

    def resolve_device(self) -> int:
        """Turn completed device spans into spans; returns how many are still pending."""
        if not self._device or self._ref is None:
            return len(self._device)
        ref, ref_ns = self._ref
        pending = []
        for name, cat, s, e, tid, args in self._device:
            if e.query():
                t0 = ref_ns + int(ref.elapsed_time(s) * 1e6)
                t1 = ref_ns + int(ref.elapsed_time(e) * 1e6)
                self._recorded += 1
                self.spans.append((name, cat, t0, t1, tid, {**args, "device": True}))
            else:
                pending.append((name, cat, s, e, tid, args))
        self._device = pending
        return len(pending)

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
        self._recorded = 0

    # ------------------------------------------------------------------------ outputs
    def report(self) -> Any:
        """The :class:`~overlap.trace.report.OverlapReport` of what was recorded."""
        from overlap.trace.report import OverlapReport

        self.resolve_device()
        return OverlapReport.from_spans(self.spans, world=self.world)

    def export_chrome(self, path: str) -> str | None:
        """Write a Chrome/Perfetto trace. In a job, every rank calls it; rank 0 writes one
        merged file with the ranks' clocks aligned. A path ending in ``.gz`` is gzipped (as
        torch.profiler's ``export_chrome_trace``). Returns the path on the writing rank.

        A path rank 0 cannot write to raises on every rank (OSError; rank 0's names the
        problem), found before the spans are sent; nothing is written then."""
        from overlap.trace.chrome import export

        self.resolve_device()
        return export(self, path)
