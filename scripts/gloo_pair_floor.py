"""What an awaited 4-byte gloo exchange costs through overlap's Handle, against a bare thread.

Run: ``.venv/bin/python scripts/gloo_pair_floor.py`` (2 gloo ranks, twice). Rank 0's
medians (us) over 1,100 rounds, each after a barrier, the three ways alternated:

* ``ref``: torch's ``dist.irecv`` + ``dist.isend`` and a ``wait()`` on each;
* ``bare``: ``pg.recv`` + ``pg.send``, both Works put on a queue that one dedicated thread
  waits on (it waits both and bumps a counter), the event loop spinning on the counter with
  ``sched_yield`` for up to 300 us (what overlap's spin does);
* ``ours``: ``await comm.sendrecv(..., async_op=True)`` on the kept exchange.

The gap between ``bare`` and ``ours`` is overlap's own machinery around the same posts
and the same thread hop (docs/architecture.md, "One call for an exchange").
"""

from __future__ import annotations

import asyncio
import os
import queue
import statistics
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

import overlap
from overlap import comm
from overlap.testing import spawn_ranks


def rank() -> dict[str, float]:
    """The three ways' medians (us) and their ratios to ``ref``, on this rank."""
    from torch.distributed.distributed_c10d import _get_default_group

    p = 1 - comm.get_rank()
    pg = _get_default_group()
    s, v = torch.ones(1), torch.zeros(1)
    q: queue.SimpleQueue[Any] = queue.SimpleQueue()
    done = [0]

    def worker() -> None:
        while True:
            item = q.get()
            if item is None:
                return
            for work in item:
                work.wait()
            done[0] += 1

    threading.Thread(target=worker, daemon=True).start()

    def ref() -> None:
        for work in (dist.irecv(v, src=p), dist.isend(s, dst=p)):
            assert work is not None
            work.wait()

    async def bare() -> None:
        n = done[0] + 1
        q.put((pg.recv([v], p, 0), pg.send([s], p, 0)))
        end = time.perf_counter() + 0.3e-3
        while done[0] < n and time.perf_counter() < end:
            os.sched_yield()
        while done[0] < n:
            await asyncio.sleep(0)

    async def ours() -> None:
        await comm.sendrecv(s, p, v, p, async_op=True)

    async def main() -> dict[str, float]:
        times: dict[str, list[float]] = {"ref": [], "bare": [], "ours": []}
        for _ in range(1200):
            for k in times:
                comm.barrier()
                t0 = time.perf_counter()
                if k == "ref":
                    ref()
                elif k == "bare":
                    await bare()
                else:
                    await ours()
                times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(x[100:]) * 1e6 for k, x in times.items()}
        return {**med, **{f"{k}/ref": m / med["ref"] for k, m in med.items()}}

    out: dict[str, float] = overlap.run(main())
    q.put(None)
    return out


if __name__ == "__main__":
    for _ in range(2):
        got = spawn_ranks(rank, 2, timeout=300)[0]
        sys.stdout.write(" ".join(f"{k} {v:.3f}" for k, v in got.items()) + "\n")
