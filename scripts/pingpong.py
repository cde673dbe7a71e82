"""A blocking ping-pong of ``comm.send`` and ``comm.recv`` against the backend's own calls.

Run on 2 ranks::

    .venv/bin/mpiexec -n 2 .venv/bin/python scripts/pingpong.py mpi [BYTES]
    .venv/bin/python scripts/pingpong.py gloo [BYTES]

(default 8 bytes). Rank 0 sends then receives, rank 1 receives then sends; rank 0 prints
the median microseconds of one round for the reference (mpi4py's ``Send`` and ``Recv`` on
buffers made once, or ``torch.distributed.send`` and ``recv``) and for overlap's, and
their ratio. Each round starts after a barrier and the two alternate, so the machine's
noise hits them alike (docs/architecture.md, "One call for an exchange").
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import overlap
from overlap import comm


def _round(first: bool, send: Callable[[], Any], recv: Callable[[], Any]) -> Callable[[], None]:
    """One round: send then receive on the rank that goes ``first``, the other way round on
    its peer."""

    def one() -> None:
        if first:
            send()
            recv()
        else:
            recv()
            send()

    return one


def rounds(nbytes: int, mpi: bool) -> dict[str, float]:
    """The medians (us) of ``ref`` and ``ours`` and their ratio, on this rank."""
    r, p = comm.get_rank(), 1 - comm.get_rank()
    t = torch.ones(max(nbytes // 4, 1))
    if mpi:
        from mpi4py import MPI

        c = MPI.COMM_WORLD
        buf = [t.view(torch.uint8).numpy(), MPI.BYTE]
        ref = _round(r == 0, lambda: c.Send(buf, p), lambda: c.Recv(buf, p))
    else:
        import torch.distributed as dist

        ref = _round(r == 0, lambda: dist.send(t, p), lambda: dist.recv(t, p))
    ours = _round(r == 0, lambda: comm.send(t, p), lambda: comm.recv(t, p))
    ways = {"ref": ref, "ours": ours}
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(3000 if mpi else 1000):
        for k, f in ways.items():
            comm.barrier()
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v[100:]) * 1e6 for k, v in times.items()}
    return {**med, "ours/ref": med["ours"] / med["ref"]}


def _gloo_rank(nbytes: int) -> dict[str, float]:
    return rounds(nbytes, False)


def main() -> None:
    kind = sys.argv[1] if len(sys.argv) > 1 else "gloo"
    nbytes = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    if kind == "mpi":
        overlap.init_distributed("mpi")
        out = rounds(nbytes, True)
        if comm.get_rank() == 0:
            sys.stdout.write(f"mpi {nbytes} B: {out}\n")
        comm.destroy_process_group()
    else:
        from overlap.testing import spawn_ranks

        out = spawn_ranks(_gloo_rank, 2, nbytes, timeout=300)[0]
        sys.stdout.write(f"gloo {nbytes} B: {out}\n")


if __name__ == "__main__":
    main()
