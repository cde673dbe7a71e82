"""Run as two processes (torchrun's environment). Rank 0 times out waiting on an all_reduce
that rank 1 never joins, then returns from the script with the op still in flight; rank 1
leaves after a pause, which fails the op on rank 0's gloo thread. Rank 0 must exit 0: exit
waits for the op's observation to end (overlap/comm/quiesce.py). Before, the failure ran the
op's Python callback during interpreter finalization and the process aborted."""

import sys
import time

import torch

import overlap
from overlap import CommTimeoutError, comm

overlap.init_distributed("gloo", timeout=20)
if comm.get_rank() == 0:
    h = comm.all_reduce(torch.ones(4), async_op=True)
    try:
        h.wait(timeout=0.5)
    except CommTimeoutError:
        print("rank 0 timed out waiting; exiting", flush=True)
else:
    time.sleep(float(sys.argv[1]))
