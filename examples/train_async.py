"""An async training loop with BucketScheduler: backward runs off the event loop while the
loop stays free (here it logs from another task), and gradients are reduced, 1-bit
compressed, bucket by bucket during backward.

    torchrun --nproc-per-node 2 examples/train_async.py
    mpiexec -n 2 python examples/train_async.py --backend mpi      # the same loop on MPI
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import torch
from torch import nn

import overlap
from overlap import comm


async def train(steps: int) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
    sched = overlap.BucketScheduler(model, compression=overlap.OneBit(warmup_steps=10))
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    true_w = torch.randn(32, 1, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(100 + comm.get_rank())
    ticks = 0

    async def heartbeat() -> None:  # proof that the loop is free while backward runs
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    beat = asyncio.ensure_future(heartbeat())
    loss = torch.tensor(0.0)
    for _ in range(steps):
        x = torch.randn(64, 32, generator=gen)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), x @ true_w)
        await sched.backward(loss)  # backward in a thread + awaited bucket reductions
        opt.step()
    beat.cancel()
    sched.remove()
    if comm.get_rank() == 0:
        sys.stdout.write(
            f"{comm.get_backend()}: {steps} steps on {comm.get_world_size()} ranks"
            f", final loss {loss.item():.4f}, {ticks} heartbeats meanwhile\n"
        )
    return float(loss)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default=None, help="gloo (default on CPU) or mpi")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    overlap.init_distributed(args.backend)
    overlap.run(train(args.steps))
    comm.destroy_process_group()


if __name__ == "__main__":
    main()
