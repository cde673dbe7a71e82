"""A script written for deepspeed.comm, run on overlap by changing only the import.

    torchrun --nproc-per-node 2 examples/deepspeed_comm.py
    mpiexec -n 2 python examples/deepspeed_comm.py --backend mpi

Everything below the import is DeepSpeed's API as its own comm tests use it: init with its
positional order, the comms logger (configure, prof=, log_name=, log_summary), the
*_fn helpers, coalesced and object collectives, monitored_barrier. overlap adds that every
async_op=True call returns a handle you may also ``await``.
"""

from __future__ import annotations

import argparse

import torch

import overlap.comm as dist  # was: import deepspeed.comm as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="gloo")
    args = ap.parse_args()

    dist.init_distributed(args.backend, True, 29500, False)  # DeepSpeed's positional order
    dist.configure(enabled=True, prof_all=False, prof_ops=["grads"])
    rank, world = dist.get_rank(), dist.get_world_size()

    grads = [torch.full((1024,), float(rank)), torch.full((64,), float(rank))]
    dist.all_reduce_coalesced(grads, op=dist.ReduceOp.AVG, log_name="grads")
    assert torch.allclose(grads[0], torch.full((1024,), (world - 1) / 2))

    t = torch.full((4096,), float(rank + 1))
    work = dist.all_reduce(t, async_op=True, prof=True)
    work.wait()  # DeepSpeed's way; overlap also allows: await work

    shard = torch.empty(4096 // world)
    dist.reduce_scatter_fn(shard, torch.ones(4096), prof=True)
    full = torch.empty(world * shard.numel())
    dist.allgather_fn(full, shard)

    config = [{"lr": 1e-3, "from": rank}] if rank == 0 else [None]
    dist.broadcast_object_list(config, src=0)
    dist.monitored_barrier(timeout=60)

    dist.log_summary()  # the comms logger's table, on rank 0
    if rank == 0:
        print(f"{args.backend}: ok on {world} ranks; config from rank {config[0]['from']}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
