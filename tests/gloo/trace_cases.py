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
