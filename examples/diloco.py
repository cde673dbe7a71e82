"""Streaming DiLoCo in an async training loop: each rank trains on its own, fragments of
the model sync in turn every H steps, each one's outer all-reduce in flight under the next
inner steps (``await diloco.astep()`` returns while it is), and ``afinish()`` ends every
rank on the same model.

    torchrun --nproc-per-node 2 examples/diloco.py
    mpiexec -n 2 python examples/diloco.py --backend mpi

``--trace t.json`` records the syncs (a Chrome/Perfetto trace, and how long the training
loop waited for them); ``--fragments 1 --delay 0 --compression none`` is plain DiLoCo, which
waits for every sync, to compare.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

import overlap
from overlap import comm


async def train(args: argparse.Namespace) -> None:
    torch.manual_seed(0)  # every rank builds the same model (DiLoCo checks, and broadcasts)
    w = args.width
    model = nn.Sequential(nn.Linear(32, w), nn.Tanh(), nn.Linear(w, w), nn.Tanh(), nn.Linear(w, 1))
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tracer = overlap.Tracer() if args.trace else None
    diloco = overlap.DiLoCo(
        model,
        inner,
        sync_every=args.sync_every,
        fragments=args.fragments,
        delay=args.delay,
        compression=overlap.Int8() if args.compression == "int8" else None,
        tracer=tracer,
    )
    true_w = torch.randn(32, 1, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(100 + comm.get_rank())  # each rank its own data
    for _ in range(args.steps):
        x = torch.randn(64, 32, generator=gen)
        if tracer is not None:
            with tracer.span("forward+backward"):  # the compute a sync can hide under
                loss = nn.functional.mse_loss(model(x), x @ true_w)
                loss.backward()
        else:
            loss = nn.functional.mse_loss(model(x), x @ true_w)
            loss.backward()
        inner.step()
        inner.zero_grad()
        await diloco.astep()  # returns while a fragment's reduction is in flight
    await diloco.afinish()  # what is in flight lands; what differs syncs once more
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(comm.get_world_size())]
    comm.all_gather(every, flat)
    same = all(torch.equal(x, flat) for x in every)
    x = torch.randn(256, 32, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        held_out = float(nn.functional.mse_loss(model(x), x @ true_w))
    stats = diloco.statistics()
    diloco.remove()
    waited = ""
    if tracer is not None:
        tracer.detach()
        report = tracer.report()
        tracer.export_chrome(args.trace)  # every rank calls it; rank 0 writes the file
        waited = f", waited for syncs {report.wait_ms:.1f} ms in all"
    if comm.get_rank() == 0:
        fp32 = flat.numel() * 4  # what DDP's allreduce puts in per step, before its ring
        sys.stdout.write(
            f"{comm.get_backend()}: {args.steps} steps on {comm.get_world_size()} ranks, "
            f"{stats['syncs']} fragment syncs, {stats['bytes_per_step']:.0f} bytes a step "
            f"(fp32 gradients: {fp32}), held-out loss {held_out:.4f}, "
            f"every rank the same model: {same}{waited}\n"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default=None, help="gloo (default on CPU) or mpi")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sync-every", type=int, default=8)
    parser.add_argument("--fragments", type=int, default=2)
    parser.add_argument("--delay", type=int, default=1)
    parser.add_argument("--compression", choices=["int8", "none"], default="int8")
    parser.add_argument("--width", type=int, default=64, help="hidden width of the model")
    parser.add_argument("--trace", default=None, help="write a Chrome trace of the syncs here")
    args = parser.parse_args()
    overlap.init_distributed(args.backend)
    overlap.run(train(args))
    comm.destroy_process_group()


if __name__ == "__main__":
    main()
