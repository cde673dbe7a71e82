"""Streaming DiLoCo in an async training loop: each rank trains on its own, fragments of
the model sync in turn every H steps, each one's outer all-reduce in flight under the next
inner steps (``await diloco.astep()`` returns while it is), and ``afinish()`` ends every
rank on the same model.

    torchrun --nproc-per-node 2 examples/diloco.py
    mpiexec -n 2 python examples/diloco.py --backend mpi
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

import overlap
from overlap import comm


async def train(steps: int, sync_every: int) -> None:
    torch.manual_seed(0)  # every rank builds the same model (DiLoCo checks, and broadcasts)
    model = nn.Sequential(
        nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)
    )
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    diloco = overlap.DiLoCo(
        model, inner, sync_every=sync_every, fragments=2, delay=1, compression=overlap.Int8()
    )
    true_w = torch.randn(32, 1, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(100 + comm.get_rank())  # each rank its own data
    for _ in range(steps):
        x = torch.randn(64, 32, generator=gen)
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
    if comm.get_rank() == 0:
        fp32 = flat.numel() * 4  # what DDP's allreduce puts in per step, before its ring
        sys.stdout.write(
            f"{comm.get_backend()}: {steps} steps on {comm.get_world_size()} ranks, "
            f"{stats['syncs']} fragment syncs, {stats['bytes_per_step']:.0f} bytes a step "
            f"(fp32 gradients: {fp32}), held-out loss {held_out:.4f}, "
            f"every rank the same model: {same}\n"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default=None, help="gloo (default on CPU) or mpi")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sync-every", type=int, default=8)
    args = parser.parse_args()
    overlap.init_distributed(args.backend)
    overlap.run(train(args.steps, args.sync_every))
    comm.destroy_process_group()


if __name__ == "__main__":
    main()
