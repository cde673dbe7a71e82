"""A rank that all-reduces in a loop until the job breaks, then records how it broke.

    fault_script.py OUT_DIR TIMEOUT_S [train]

Each rank writes OUT_DIR/ready.<rank> after its first all_reduce and, when one fails,
OUT_DIR/error.<rank> with the error's type and the seconds since its last success.
``train``: the loop is training steps of a BucketScheduler with OneBit, hierarchical on
several hosts (buckets pipelined through the exchange inside the host and across hosts).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time

import torch

import overlap
from overlap import comm


def _record(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically: the test polls for the file and reads it at
    once, so it must never see it created but still empty."""
    with open(path + ".part", "w") as f:
        f.write(text)
    os.replace(path + ".part", path)


def main() -> None:
    out, timeout = sys.argv[1], float(sys.argv[2])
    # SIGUSR1 writes every thread's stack to OUT_DIR/stacks.<pid>: the test asks for them
    # when host 0's ranks do not report a broken job in time (a rare hang to take apart)
    stacks = open(os.path.join(out, f"stacks.{os.getpid()}"), "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    overlap.init_distributed(timeout=timeout)
    rank = comm.get_rank()
    x = torch.ones(1024)
    one = comm.all_reduce
    if len(sys.argv) > 3 and sys.argv[3] == "train":
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        sched = overlap.BucketScheduler(
            model,
            compression=overlap.OneBit(warmup_steps=1),
            bucket_cap_mb=0.02,
            first_bucket_mb=0.02,
        )
        assert sched.hierarchical, "2 hosts x 2 ranks should reduce hierarchically"
        batch = torch.randn(8, 64)

        def one(x: torch.Tensor, op: str) -> None:
            model(batch).pow(2).mean().backward()
            sched.synchronize()

    last = time.monotonic()
    try:
        for i in range(1_000_000):
            one(x, op="avg")
            last = time.monotonic()
            if i == 0:
                # the pid names rank 0's shared regions (hierarchy)
                _record(os.path.join(out, f"ready.{rank}"), str(os.getpid()))
            time.sleep(0.01)
    except Exception as e:  # what the user sees: the type and when
        text = f"{type(e).__name__} {time.monotonic() - last:.2f} {str(e)[:300]}"
        _record(os.path.join(out, f"error.{rank}"), text)
        # torchrun's agent stops a host's other ranks once one of them exits: stay until they
        # have recorded their own errors (or long past the test's patience, so that a rank
        # that really hangs is still there for the test to take its stacks)
        local = comm.get_local_world_size()
        first = comm.get_node_rank() * local
        peers = [os.path.join(out, f"error.{r}") for r in range(first, first + local)]
        deadline = time.monotonic() + timeout + 40
        while not all(map(os.path.exists, peers)) and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(3)


if __name__ == "__main__":
    main()
