"""Under ``mpiexec -disable-auto-cleanup -n 2``: rank 1 dies mid-operation; rank 0 must get
CommError within the job timeout (+5 s) and exit by itself. Usage: peer_death.py WHERE."""

from __future__ import annotations

import os
import sys
import time

import torch
from torch import nn

import overlap
from overlap import comm

TIMEOUT = 5.0


def main(where: str) -> None:
    overlap.init_distributed("mpi", timeout=TIMEOUT)
    r = comm.get_rank()
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    sched = (
        overlap.BucketScheduler(model, bucket_cap_mb=0.02, first_bucket_mb=0.02)
        if where == "bucket"
        else None
    )
    t = torch.ones(1 << 16)
    comm.all_reduce(t)  # seen before: the op below takes its ready call, under the timeout
    u = torch.zeros(1 << 16)
    comm.sendrecv(t, 1 - r, u, 1 - r)  # kept: the exchange below is posted straight to MPI
    comm.barrier()
    if r == 1:
        time.sleep(0.2)
        os._exit(3)  # dies without a word while rank 0 is inside the op
    t0 = time.monotonic()
    try:
        if where == "collective":
            overlap.run(_await_all_reduce(t))
        elif where == "blocking":
            comm.all_reduce(t)
        elif where == "sendrecv":
            comm.sendrecv(t, 1, u, 1)
        elif where == "compressed":
            from overlap.compression import compressed_allreduce, padded_numel

            n = 1 << 14
            P = padded_numel(n, 2)
            compressed_allreduce(torch.ones(n), torch.zeros(P), torch.zeros(P // 2))
        else:
            assert sched is not None
            time.sleep(0.5)
            model(torch.randn(8, 64)).sum().backward()
            sched.synchronize()
        result = "no error"
    except overlap.CommError as e:
        result = f"CommError {type(e).__name__}"
    sys.stdout.write(f"RANK0 {where} {result} after {time.monotonic() - t0:.2f}s\n")
    sys.stdout.flush()


async def _await_all_reduce(t: torch.Tensor) -> None:
    await comm.all_reduce(t, async_op=True)


if __name__ == "__main__":
    main(sys.argv[1])
