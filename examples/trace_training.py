"""Trace a training run: every rank records; rank 0 writes one merged Chrome trace and
prints the overlap report.

    torchrun --nproc-per-node 2 examples/trace_training.py --out trace.json
    overlap trace summarize trace.json        # later, from the file
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

import overlap
from overlap import comm


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="overlap-trace.json")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    overlap.init_distributed()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(6)])
    tracer = overlap.Tracer()
    sched = overlap.BucketScheduler(model, bucket_cap_mb=0.3, first_bucket_mb=0.26, tracer=tracer)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(256, 256)
    for _ in range(args.steps):
        opt.zero_grad()
        with tracer.span("forward"):
            loss = model(x).pow(2).mean()
        loss.backward()
        sched.synchronize()
        opt.step()
    written = tracer.export_chrome(args.out)  # every rank calls it; rank 0 writes
    if written:
        sys.stdout.write(tracer.report().render() + f"\nwrote {written}\n")
    sched.remove()
    comm.destroy_process_group()


if __name__ == "__main__":
    main()
