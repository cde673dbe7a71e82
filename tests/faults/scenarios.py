"""Rank-side fault scenarios, one per tool of tests.faults.inject; each returns what the
test asserts (test_faults.py runs them on gloo ranks, and under mpiexec where it says)."""

from __future__ import annotations

import time
from typing import Any

import torch

from overlap import comm
from overlap.errors import CommError
from tests.faults.inject import FaultAt, InjectedFault, abandon_await, issue_and_drop, on_rank
from tests.polling import until


def peer_fails_at_op(action: str, victim: int, at: int = 4, stop_s: float = 5.0) -> dict[str, Any]:
    """Ten all_reduces; ``victim`` is killed, or stopped for ``stop_s``, at its ``at``-th.
    The others report the error type they got and how long it took (each rank reaches op
    ``at`` at nearly the same time: a barrier first)."""
    comm.barrier()
    t0 = time.monotonic()
    got: str | None = None
    done = 0
    try:
        with FaultAt("all_reduce", at, action, ranks=[victim], stop_s=stop_s):
            for _ in range(10):
                comm.all_reduce(torch.ones(64))
                done += 1
    except CommError as exc:
        got = type(exc).__name__
    return {"error": got, "after_s": time.monotonic() - t0, "done": done}


def injected_raise_on_one_rank() -> dict[str, Any]:
    """A ``"raise"`` fault stops rank 0 before its 2nd broadcast is issued: only that rank
    raises; the others' broadcast waits for it, and gets rank 0's value when it is issued
    late (nothing is corrupted by the missing rank)."""
    r = comm.get_rank()
    t = torch.full((4,), float(r))
    comm.broadcast(t, 0)
    raised = False
    h = None
    try:
        with FaultAt("broadcast", 1, "raise", ranks=[0]):
            h = comm.broadcast(torch.full((4,), 9.0) if r == 0 else t, 0, async_op=True)
    except InjectedFault:
        raised = True
    if r == 0:
        comm.broadcast(torch.full((4,), 9.0), 0)  # the call rank 0 owed, issued late
        return {"raised": raised, "value": 9.0}
    assert h is not None
    h.wait(30)
    return {"raised": raised, "value": float(t[0])}


def bad_argument_on_the_root_only() -> dict[str, Any]:
    """``gather`` with no ``gather_list`` on the root only: the root raises ValueError after
    taking part with scratch buffers; the others finish; the next op is in step."""
    r, w = comm.get_rank(), comm.get_world_size()
    good = [torch.zeros(2) for _ in range(w)]
    err = None
    try:
        comm.gather(torch.full((2,), float(r)), on_rank(0, None, good if r == 0 else None), dst=0)
    except ValueError as exc:
        err = str(exc)
    t = torch.ones(3)
    comm.all_reduce(t)
    return {"error": err, "next_ok": t.tolist() == [float(w)] * 3}


def dropped_handle_finishes() -> bool:
    """A ring all_reduce (multi-phase) whose handle is dropped at once still reduces the
    tensor, while the other rank waits on its own handle."""
    r, w = comm.get_rank(), comm.get_world_size()
    t = torch.full((8,), float(r))
    if r == 0:
        ref = issue_and_drop(lambda: comm.all_reduce(t, algorithm="ring", async_op=True))
        until(lambda: ref() is None, 20, every=0.01)  # it lives until done
    else:
        comm.all_reduce(t, algorithm="ring", async_op=True).wait(20)
    comm.barrier()
    return t.tolist() == [w * (w - 1) / 2] * 8


def loop_closed_under_an_await() -> dict[str, Any]:
    """Rank 0 awaits an all_reduce on a loop that gives up after 10 ms and closes, while the
    last rank joins 0.5 s late: the op completes anyway, and the wait afterwards gets it."""
    r, w = comm.get_rank(), comm.get_world_size()
    t = torch.full((4,), float(r))
    timed_out = False
    if r == w - 1:
        time.sleep(0.5)
        h = comm.all_reduce(t, async_op=True)
    else:
        h = comm.all_reduce(t, async_op=True)
        timed_out = abandon_await(h, 0.01) if r == 0 else False
    out = h.wait(20)
    return {"timed_out": timed_out, "value": float(out[0]), "want": w * (w - 1) / 2}
