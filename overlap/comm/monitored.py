"""monitored_barrier: a barrier that names the ranks that did not arrive.

Every member sends a token to the group's first rank and waits for its release; the first
rank waits for each token against one deadline, then releases everyone. A rank missing at
the deadline is named in a :class:`~overlap.errors.CommError` on the first rank (the first
one missing, or all of them with ``wait_all_ranks=True``); the others fail when no release
comes by the same deadline. Built on overlap's point-to-point ops with two reserved tags, so
it works on gloo, NCCL and MPI (torch's own ``monitored_barrier`` is gloo only).

A failure means a rank hung or died: stop the job, as after torch's. The receives of the
release stay posted on the ranks that timed out (no backend can cancel a posted receive), and
gloo closes those pairs once they reach the job timeout, so the group is not usable after.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch

from overlap.comm.seconds import positive_seconds
from overlap.errors import CommError, CommTimeoutError

__all__ = ["monitored_barrier"]


def _seconds(timeout: Any) -> float:
    from overlap.comm import state
    from overlap.comm.constants import default_pg_timeout

    if timeout is None:
        job = getattr(state.active(), "timeout", None)
        if isinstance(job, datetime.timedelta):
            return job.total_seconds()
        if isinstance(job, (int, float)) and job > 0:
            return float(job)
        return default_pg_timeout.total_seconds()
    return positive_seconds(timeout)


def monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> None:
    """Wait until every rank of ``group`` arrives, or fail naming who did not (module doc)."""
    from overlap import comm
    from overlap.comm import state
    from overlap.comm.p2p import MONITORED_BARRIER_TAGS

    secs = _seconds(timeout)
    b = state.active()
    w, me = comm.get_world_size(group), comm.get_rank(group)
    if w == 1:
        return
    arrive, release = MONITORED_BARRIER_TAGS
    dev = torch.device("cuda", torch.cuda.current_device()) if b.name == "nccl" else None
    deadline = time.monotonic() + secs
    root = comm.get_global_rank(group, 0)
    if me != 0:
        token = torch.zeros(1, device=dev)
        try:
            b.isend(token, root, group, arrive).wait(secs)
            b.irecv(token, root, group, release).wait(max(deadline - time.monotonic(), 0.001))
        except CommTimeoutError as exc:
            raise CommError(
                f"monitored_barrier: rank {comm.get_rank()} was not released by rank {root} "
                f"within {secs:g} s: another rank did not reach the barrier (rank {root} "
                "names it)"
            ) from exc
        return
    members = [comm.get_global_rank(group, i) for i in range(1, w)]
    tokens = [torch.zeros(1, device=dev) for _ in members]
    handles = [b.irecv(t, r, group, arrive) for t, r in zip(tokens, members, strict=True)]
    missing: list[int] = []
    for r, h in zip(members, handles, strict=True):
        try:
            h.wait(max(deadline - time.monotonic(), 0.001))
        except CommTimeoutError:
            missing.append(r)
            if not wait_all_ranks:
                break
    if missing:
        which = "Ranks" if len(missing) > 1 else "Rank"
        raise CommError(
            f"monitored_barrier: {which} {', '.join(map(str, missing))} did not reach the "
            f"barrier within {secs:g} s (a hang or a crash there; its own log says which)"
        )
    for h in [b.isend(torch.zeros(1, device=dev), r, group, release) for r in members]:
        h.wait(max(deadline - time.monotonic(), 0.001))
