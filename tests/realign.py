"""Bring the ranks of a test back in line after a one-rank failure, without a collective.

After one rank stops, its peers stop at different times: at once where they learn it from
the scheduler's vote, or at the job's timeout where they learn it from a collective that
never completes. A collective of the job's group that follows would then wait out that gap
on the first rank to reach it, and with the short timeouts these tests use, time out. So
the ranks meet outside overlap: on gloo through the job's rendezvous store, under mpiexec
through mpi4py's barrier on COMM_WORLD (which overlap's groups never use directly).
"""

from __future__ import annotations

import time

import torch.distributed as dist

from overlap import comm

_calls = 0


def realign(deadline: float = 60.0) -> None:
    """Return once every rank of the job has called this as often as this rank has; an
    AssertionError after ``deadline`` seconds (a rank that never comes)."""
    global _calls
    _calls += 1
    if comm.get_backend() == "mpi":
        from mpi4py import MPI

        MPI.COMM_WORLD.Barrier()
        return
    store = dist.distributed_c10d._get_default_store()
    key, want = f"tests.realign.{_calls}", comm.get_world_size()
    store.add(key, 1)
    end = time.monotonic() + deadline
    while store.add(key, 0) < want:
        assert time.monotonic() < end, f"a rank did not reach realign() within {deadline} s"
        time.sleep(0.01)
