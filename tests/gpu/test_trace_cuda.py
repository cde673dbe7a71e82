"""Device spans in a single process."""

from __future__ import annotations

import torch


def test_device_spans_resolve_without_a_device_wide_sync() -> None:
    from overlap.trace import Tracer

    t = Tracer()
    a = torch.randn(2048, 2048, device="cuda")
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    a @ a
    e.record()
    t.device_span("matmul", "compute", s, e)
    assert t.resolve_device() in (0, 1)  # not forced: pending until the event completes
    e.synchronize()
    assert t.resolve_device() == 0
    name, cat, t0, t1, _, args = t.spans[-1]
    assert cat == "compute"
    assert name == "matmul" and args["device"] and t1 > t0
