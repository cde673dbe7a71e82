"""What an 8-byte MPI sendrecv costs through the thinnest Python handles, against overlap's.

Run on 2 ranks: ``.venv/bin/mpiexec -n 2 .venv/bin/python scripts/mpi_p2p_floor.py
[BYTES]`` (default 8). Rank 0 prints the median microseconds of one ``irecv`` + ``isend``
pair of BYTES each, both waited, for:

* ``mpi4py``: ``Irecv``, ``Isend``, ``Waitall`` on buffers made once (the reference of
  ``overlap bench ops --backend mpi --op sendrecv``);
* ``bare``: a two-slot handle per op over a cached post, and ``Wait``: the least any
  Python wrapper that returns a handle per op can cost;
* ``minimal``: a handle with what overlap's contracts need at the least: a lock per op
  (only one thread may complete an MPI request), the receive's Status read (its sender
  and size), the send tested once at its post (docs/architecture.md, "A test at the post");
* ``overlap``: ``comm.irecv`` + ``comm.isend`` and their ``wait()``.

Each iteration starts after a barrier, and the four alternate, so the machine's noise hits
them alike (docs/architecture.md, "The floor of a Python handle").
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from mpi4py import MPI

import overlap
from overlap import comm

ROUNDS, SKIP = 6000, 1000  # fewer above 64 KiB (see main)


class Bare:
    __slots__ = ("req", "result")

    def __init__(self, req: Any, result: Any) -> None:
        self.req, self.result = req, result

    def wait(self) -> Any:
        self.req.Wait()
        return self.result


class Minimal:
    __slots__ = ("lock", "req", "result", "source", "state", "status")

    def __init__(self, req: Any, result: Any) -> None:
        self.req, self.result, self.state = req, result, 0
        self.lock = threading.Lock()
        self.status: Any = None
        self.source = -1

    def wait(self) -> Any:
        with self.lock:
            if self.state == 0:
                status = self.status = MPI.Status()
                self.req.Wait(status)
                self.source = status.Get_source()
                if status.Get_count(MPI.BYTE) < 0:
                    raise RuntimeError("unreachable: a negative count")
                self.state = 1
        return self.result


def main() -> None:
    overlap.init_distributed("mpi")
    if comm.get_world_size() != 2:
        raise SystemExit("run on 2 ranks: mpiexec -n 2 python scripts/mpi_p2p_floor.py")
    peer = 1 - comm.get_rank()
    world = MPI.COMM_WORLD
    n = max(int(sys.argv[1]) // 4 if len(sys.argv) > 1 else 2, 1)
    send, recv = torch.ones(n), torch.empty(n)
    rbuf = [recv.view(torch.uint8).numpy(), MPI.BYTE]
    sbuf = [send.view(torch.uint8).numpy(), MPI.BYTE]
    posts: dict[tuple[str, int, int], Callable[[], Any]] = {}

    def post(kind: str, t: torch.Tensor) -> Any:
        key = (kind, t.data_ptr(), peer)
        start = posts.get(key)
        if start is None:
            buf = rbuf if kind == "r" else sbuf
            fn = world.Irecv if kind == "r" else world.Isend
            start = posts[key] = lambda: fn(buf, peer)
        return start()

    def raw() -> None:
        MPI.Request.Waitall([world.Irecv(rbuf, peer), world.Isend(sbuf, peer)])

    def bare() -> None:
        hs = [Bare(post("r", recv), recv), Bare(post("s", send), send)]
        for h in hs:
            h.wait()

    def minimal() -> None:
        r = Minimal(post("r", recv), recv)
        s = Minimal(post("s", send), send)
        s.req.Test()
        for h in (r, s):
            h.wait()

    def ours() -> None:
        hs = [comm.irecv(recv, src=peer), comm.isend(send, dst=peer)]
        for h in hs:
            h.wait()

    ways = {"mpi4py": raw, "bare": bare, "minimal": minimal, "overlap": ours}
    times: dict[str, list[float]] = {k: [] for k in ways}
    clock = time.perf_counter
    rounds, skip = (ROUNDS, SKIP) if n * 4 <= 1 << 16 else (ROUNDS // 4, SKIP // 4)
    for _ in range(rounds):
        for name, fn in ways.items():
            world.Barrier()
            t0 = clock()
            fn()
            times[name].append(clock() - t0)
    if comm.get_rank() == 0:
        ref = statistics.median(times["mpi4py"][skip:])
        for name, ts in times.items():
            med = statistics.median(ts[skip:])
            print(f"{name:8s} {med * 1e6:6.2f} us  {med / ref:4.2f}x mpi4py")
    comm.destroy_process_group()


if __name__ == "__main__":
    main()
