"""A Horovod training script, ported: each overlap line says which Horovod line it replaces.

    torchrun --nproc-per-node 2 examples/from_horovod.py
    mpiexec -n 2 python examples/from_horovod.py --backend mpi

The habits it keeps: rank 0 alone loads a checkpoint, then broadcasts the weights and the
optimizer state; gradients are averaged with fp16 on the wire; two backward passes per
step; metrics averaged across ranks. docs/api.md, "Coming from Horovod", has the table.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import overlap
from overlap import comm


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    overlap.init_distributed(args.backend)  # hvd.init()
    rank, size = comm.get_rank(), comm.get_world_size()  # hvd.rank(), hvd.size()

    torch.manual_seed(rank)  # the ranks start apart, as without a broadcast
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2 * size)  # lr scaled by size, as usual
    if rank == 0:  # "if hvd.rank() == 0: load the checkpoint": here, a few steps of training
        for _ in range(3):
            model(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    # hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    overlap.broadcast_parameters(model.state_dict(), src=0)
    # hvd.broadcast_optimizer_state(opt, root_rank=0)
    overlap.broadcast_optimizer_state(opt, src=0)

    # opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
    #                                compression=hvd.Compression.fp16,
    #                                backward_passes_per_step=2)
    # (the weights already agree, so the scheduler's own start-up broadcast changes nothing)
    sched = overlap.BucketScheduler(model, compression=overlap.FP16())

    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    target = torch.ones(1)
    for _ in range(args.steps):
        opt.zero_grad()
        with sched.no_sync():  # backward_passes_per_step=2: the first pass accumulates
            loss = (model(torch.randn(8, 16, generator=gen)) - target).pow(2).mean()
            (loss / 2).backward()
        loss = (model(torch.randn(8, 16, generator=gen)) - target).pow(2).mean()
        (loss / 2).backward()
        sched.synchronize()  # Horovod's optimizer waits inside step(); here before it
        opt.step()

    # hvd.allreduce(loss) averages by default; overlap's (torch's) default op is SUM
    mean_loss = comm.all_reduce(loss.detach().clone(), op="avg")
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    lo, hi = flat.clone(), flat.clone()
    comm.all_reduce(lo, op="min")
    comm.all_reduce(hi, op="max")
    if rank == 0:
        same = torch.equal(lo, hi)
        print(
            f"{comm.get_backend()}: {args.steps} steps on {size} ranks, mean loss "
            f"{mean_loss.item():.4f}, same weights on every rank: {same}"
        )
    sched.remove()
    overlap.destroy_process_group()  # hvd.shutdown()


if __name__ == "__main__":
    main()
