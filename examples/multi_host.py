"""One script for one host or many: nothing in it names a host, an interface or a port.

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint HOST0:29400 --rdzv-id job1 examples/multi_host.py     # on each host
    mpiexec -n 4 -ppn 2 -hosts HOST0,HOST1 python examples/multi_host.py --backend mpi

Every rank reports where it runs (global rank, local rank, local world size, node rank),
averages a tensor, trains a small model for a few steps with the BucketScheduler (1-bit
compressed), and checks that every rank holds the same weights. Rank 0 prints one line
``RESULT {...}`` (JSON) that tests and scripts can read.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

import overlap
from overlap import comm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default=None, help="gloo (default on CPU), nccl or mpi")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()

    overlap.init_distributed(args.backend)
    rank, world = comm.get_rank(), comm.get_world_size()
    where = torch.tensor(
        [rank, comm.get_local_rank(), comm.get_local_world_size(), comm.get_node_rank()],
        dtype=torch.int64,
    )
    table = [torch.zeros_like(where) for _ in range(world)]
    comm.all_gather(table, where)

    x = torch.full((1000,), float(rank))
    comm.all_reduce(x, op="avg")
    mean_ok = bool(torch.allclose(x, torch.full_like(x, (world - 1) / 2)))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 8))
    sched = overlap.BucketScheduler(model, compression=overlap.OneBit(warmup_steps=1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(args.steps):
        opt.zero_grad()
        model(torch.randn(16, 64, generator=gen)).pow(2).mean().backward()
        sched.synchronize()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    lo, hi = flat.clone(), flat.clone()
    comm.all_reduce(lo, op="min")
    comm.all_reduce(hi, op="max")
    same = bool(torch.equal(lo, hi))
    sched.remove()
    if rank == 0:
        print(
            "RESULT "
            + json.dumps(
                {
                    "backend": comm.get_backend(),
                    "world": world,
                    "placement": [t.tolist() for t in table],
                    "mean_ok": mean_ok,
                    "same_weights": same,
                }
            ),
            flush=True,
        )
    comm.destroy_process_group()


if __name__ == "__main__":
    main()
