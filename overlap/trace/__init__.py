"""Overlap traces: record spans from every layer, export Chrome/Perfetto JSON, report overlap."""

from __future__ import annotations

from overlap.trace.chrome import TraceFormatError, load_spans
from overlap.trace.recorder import Tracer, current
from overlap.trace.report import OverlapReport

__all__ = ["OverlapReport", "TraceFormatError", "Tracer", "current", "load_spans"]
