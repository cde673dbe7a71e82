"""Run as two processes (torchrun's environment). Rank 0 builds a OneBit BucketScheduler,
runs a backward and ends the program with the step's buckets still queued on the scheduler's
thread, while rank 1 waits. Rank 0 must exit 0 and say nothing: the job is torn down at exit
(overlap.comm.quiesce.release_at_exit), and the bucket that finds it gone is the exit's
doing. Without ``quiesce.tearing_down()`` (fifty-eighth session) the teardown made the
scheduler log "a bucket's reduction raised an error on this rank only (NotInitializedError
...)"."""

import sys
import time

import torch

import overlap
from overlap import comm

overlap.init_distributed("gloo", timeout=3)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
sched = overlap.BucketScheduler(model, compression=overlap.OneBit())
if comm.get_rank() == 0:
    model(torch.randn(8, 64)).sum().backward()  # the step's buckets go to the worker
    print("rank 0 ends with a step in flight", flush=True)
else:
    time.sleep(float(sys.argv[1]))
