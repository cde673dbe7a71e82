"""Align the ranks' monotonic clocks at export time (NTP-style ping-pong with rank 0).

For each rank r > 0, rank 0 and r exchange a few timestamped messages; with the round trip
of least delay, offset_r = ((t1 - t0) + (t2 - t3)) / 2 is r's clock minus rank 0's, good to
about half that round trip. Spans are shifted by -offset_r before merging.
"""

from __future__ import annotations

import torch

__all__ = ["clock_offsets"]

ROUNDS = 8
_TAG = 30_500


def clock_offsets() -> list[int]:
    """Every rank's offset (ns) from rank 0's perf_counter_ns; [0] for one rank. Collective."""
    import time

    from overlap import comm

    if not comm.is_initialized() or comm.get_world_size() == 1:
        return [0]
    r, w = comm.get_rank(), comm.get_world_size()
    mine = torch.zeros(1, dtype=torch.int64)
    buf = torch.zeros(2, dtype=torch.int64)
    for peer in range(1, w):
        if r == 0:
            best = None
            for _ in range(ROUNDS):
                t0 = time.perf_counter_ns()
                comm.send(torch.tensor([t0], dtype=torch.int64), dst=peer, tag=_TAG)
                comm.recv(buf, src=peer, tag=_TAG)
                t3 = time.perf_counter_ns()
                t1, t2 = int(buf[0]), int(buf[1])
                delay = (t3 - t0) - (t2 - t1)
                if best is None or delay < best[0]:
                    best = (delay, ((t1 - t0) + (t2 - t3)) // 2)
            assert best is not None
            comm.send(torch.tensor([best[1]], dtype=torch.int64), dst=peer, tag=_TAG)
        elif r == peer:
            ping = torch.zeros(1, dtype=torch.int64)
            for _ in range(ROUNDS):
                comm.recv(ping, src=0, tag=_TAG)
                t1 = time.perf_counter_ns()
                comm.send(
                    torch.tensor([t1, time.perf_counter_ns()], dtype=torch.int64), dst=0, tag=_TAG
                )
            comm.recv(mine, src=0, tag=_TAG)
    everyone = comm.all_gather(mine)
    return [int(t.item()) for t in everyone]
