"""A traced 2-rank scheduler run; rank 0 writes the merged trace."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import overlap
from overlap import BucketScheduler, comm


def traced_training(path: str) -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(8)])
    tracer = overlap.Tracer()
    sched = BucketScheduler(model, bucket_cap_mb=0.3, first_bucket_mb=0.26, tracer=tracer)
    x = torch.randn(256, 256)
    for _ in range(3):
        with tracer.span("forward"):
            loss = model(x).pow(2).mean()
        loss.backward()
        sched.synchronize()
    comm.all_reduce(torch.ones(4))  # an op outside the scheduler is traced too
    nbuckets = len(sched.buckets)
    out = tracer.export_chrome(path)
    sched.remove()
    tracer.detach()
    return {"written": out, "buckets": nbuckets}


def export_on_rank_0_only(path: str, wait_s: float) -> str:
    """export_chrome under ``if rank == 0:``: rank 0 fails at the job timeout with an
    error that says the export is collective (before: gloo's "Timed out waiting ... for send
    operation to complete", naming an isend); rank 1 does not call it."""
    import time

    tracer = overlap.Tracer().attach()
    try:
        comm.all_reduce(torch.ones(2))
        if comm.get_rank() != 0:
            time.sleep(wait_s)
            return "not called"
        try:
            tracer.export_chrome(path)
        except overlap.CommError as exc:
            return f"{type(exc).__name__}: {exc}"
        return "no error"
    finally:
        tracer.detach()


def export_to_a_path_rank_0_cannot_write(folder: str) -> list[str]:
    """Rank 0 writes the merged trace; a path it cannot write to raised there alone before
    (the other ranks returned as if the trace was written). Now every rank raises, nothing
    is written, and the next export, to a good path, works on every rank."""
    import os

    tracer = overlap.Tracer().attach()
    out: list[str] = []
    try:
        comm.all_reduce(torch.ones(2))
        bad = ["", folder, os.path.join(folder, "no", "such", "t.json")]
        for path in bad if comm.get_rank() == 0 else [os.path.join(folder, "t.json")] * 3:
            try:
                out.append(f"no error: {tracer.export_chrome(path)}")
            except OSError as exc:
                out.append(f"{type(exc).__name__}: {exc}")
        out.append(f"then: {tracer.export_chrome(os.path.join(folder, 'good.json'))}")
    finally:
        tracer.detach()
    return out


def tracer_released_by_remove() -> dict[str, Any]:
    """A scheduler's tracer is attached while it holds it and detached by its remove(), so a
    second scheduler's tracer records the comm layer's ops (before: the first stayed
    attached, and the second recorded no comm span, silently). A tracer the user attached
    stays attached; two owners of one tracer keep it attached until both are removed."""
    from overlap.trace.recorder import current

    def comm_spans(tracer: overlap.Tracer) -> int:
        return sum(1 for s in tracer.spans if s[1] == "comm")

    out: dict[str, Any] = {}
    model = nn.Linear(4, 4)
    x = torch.ones(2, 4)
    for name in ("first", "second"):
        tracer = overlap.Tracer()
        sched = BucketScheduler(model, tracer=tracer)
        out[f"{name}_attached"] = current() is tracer
        model(x).sum().backward()
        sched.synchronize()
        sched.remove()
        out[f"{name}_comm_spans"] = comm_spans(tracer)
        out[f"{name}_detached"] = current() is None
    mine = overlap.Tracer().attach()
    BucketScheduler(model, tracer=mine).remove()
    out["user_attached_kept"] = current() is mine
    mine.detach()
    shared = overlap.Tracer()
    a = BucketScheduler(nn.Linear(2, 2), tracer=shared)
    b = BucketScheduler(nn.Linear(3, 3), tracer=shared)
    a.remove()
    out["held_by_the_other"] = current() is shared
    b.remove()
    out["released_by_both"] = current() is None
    lin = nn.Linear(2, 2)
    d = overlap.DiLoCo(lin, torch.optim.SGD(lin.parameters(), lr=0.1), tracer=shared)
    out["diloco_holds"] = current() is shared
    d.remove()
    out["diloco_released"] = current() is None
    return out
