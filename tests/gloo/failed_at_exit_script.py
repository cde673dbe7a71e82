"""Run as two processes (torchrun's environment). Rank 0's blocking all_reduce, which rank 1
never joins, fails by the job timeout (2 s); rank 0 catches the CommError and exits at once,
the op's Work freed with the function that issued it, while rank 1 still sleeps. Rank 0
must exit 0: init_distributed's job is destroyed at exit, before the interpreter finalizes
(overlap.comm.quiesce.release_at_exit). Before (fifty-eighth session) it aborted with
"terminate called without an active exception" (exit 134), as torch alone does."""

import sys
import time

import torch

import overlap
from overlap import CommError, comm


def reduce_once() -> None:
    comm.all_reduce(torch.ones(4))


overlap.init_distributed("gloo", timeout=2)
if comm.get_rank() == 0:
    try:
        reduce_once()
    except CommError:
        print("rank 0 CommError; exiting", flush=True)
else:
    time.sleep(float(sys.argv[1]))
