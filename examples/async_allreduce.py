"""Awaitable all_reduce in an asyncio loop.

Run with: torchrun --nproc-per-node 2 examples/async_allreduce.py

Each rank issues several all_reduces at once, keeps computing, then awaits them all.
"""

from __future__ import annotations

import sys

import torch

import overlap
from overlap import comm


async def main() -> None:
    rank, world = comm.get_rank(), comm.get_world_size()
    grads = [torch.full((1024,), float(rank + i)) for i in range(4)]
    handles = [comm.all_reduce(g, op="avg", async_op=True) for g in grads]
    busy = torch.randn(256, 256) @ torch.randn(256, 256)  # compute while the ops fly
    results = await comm.collect_all(handles)  # one Handle for all four
    want = [(world - 1) / 2 + i for i in range(4)]
    assert [r[0].item() for r in results] == want, results
    if rank == 0:
        sys.stdout.write(f"averaged over {world} ranks: {want} (compute {busy.shape})\n")


if __name__ == "__main__":
    overlap.init_distributed()
    overlap.run(main())
    comm.destroy_process_group()
