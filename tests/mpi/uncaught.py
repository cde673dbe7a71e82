"""Under ``mpiexec -n 2``, no job timeout (MPI's default): rank 1 raises a RuntimeError
of its own (``raise``) or gets Ctrl-C while it runs Python (``sigint``), while rank 0
waits in a blocking all_reduce for it. The job must end, with rank 1's error reported;
before, rank 0 waited for ever and rank 1 hung in MPI_Finalize."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

import overlap
from overlap import comm


def main() -> None:
    overlap.init_distributed("mpi")
    if comm.get_rank() == 1:
        time.sleep(0.5)
        if sys.argv[1] == "sigint":
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)
        raise RuntimeError("a bug on rank 1")
    comm.all_reduce(torch.ones(1))
    print("rank 0 was not stopped", flush=True)


if __name__ == "__main__":
    main()
