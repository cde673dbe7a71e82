"""Claims of ops in flight (overlap.comm.claims), single process: which byte ranges conflict,
that a claim ends with its handle, and that an op issued on claimed memory waits for it."""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

import torch

from overlap.comm import claims
from overlap.comm.handle import Handle


def _pending(op: str = "all_reduce") -> Handle:
    return Handle(op, result=None)


def test_a_claim_ends_when_its_handle_completes() -> None:
    h = _pending()
    t = torch.ones(4)
    claims.claim(h, "all_reduce", (t,))
    assert id(h) in claims.live
    h._finish(None)
    assert id(h) not in claims.live
    dropped = _pending()
    claims.claim(dropped, "irecv", (t,))
    ref = weakref.ref(dropped)
    del dropped  # the claim does not keep a dropped handle alive (its __del__ must run)
    assert ref() is None
    claims.settle("all_reduce", (t,))  # and a check drops its entry
    assert all(ref() is not None for ref in claims.live.values())
    done = Handle.completed("all_reduce", None)
    claims.claim(done, "all_reduce", (t,))  # an op over already claims nothing
    assert id(done) not in claims.live


def test_conflicts_are_writes_over_shared_bytes() -> None:
    buf = torch.zeros(16)
    a, b, c = buf[:8], buf[4:12], buf[12:]

    def waits(mine: tuple[tuple[Any, ...], tuple[Any, ...]], theirs: tuple[Any, Any]) -> bool:
        h = _pending()
        claims.claim(h, "x", *theirs)
        try:
            t0 = time.monotonic()  # before the timer: a wait then lasts >= 0.3 s however
            threading.Timer(0.3, h._finish, (None,)).start()  # this thread is scheduled
            claims.settle("y", *mine)
            return time.monotonic() - t0 > 0.2
        finally:
            h._finish(None)

    assert waits(((a,), ()), ((b,), ()))  # write / write, overlapping
    assert waits(((a,), ()), ((), (b,)))  # write / read
    assert waits(((), (a,)), ((b,), ()))  # read / write
    assert not waits(((), (a,)), ((), (b,)))  # two reads stay concurrent
    assert not waits(((a,), ()), ((c,), ()))  # disjoint views of one buffer
    assert not waits(((buf[:4],), ()), ((buf[4:8],), ()))  # adjacent
    assert not waits(((torch.zeros(16),), ()), ((buf,), ()))  # another allocation
    # what is not a CPU tensor is left to the backend's checks; empty tensors claim nothing
    r = claims._ranges
    assert r(([1.0], None, torch.empty(0), torch.ones(2, device="meta")), ()) == ((), ())


def test_an_op_on_claimed_memory_waits_for_the_op_in_flight() -> None:
    t = torch.ones(8)
    first = _pending()
    claims.claim(first, "all_reduce", (t,))
    try:
        t0 = time.monotonic()
        threading.Timer(0.2, first._finish, (None,)).start()
        claims.settle("broadcast", (t[2:4],))
        waited = time.monotonic() - t0
        assert first.done()
        assert 0.15 < waited < 5, waited
        # a read of memory another op only reads does not wait
        reader = _pending("isend")
        claims.claim(reader, "isend", (), (t,))
        t0 = time.monotonic()
        claims.settle("isend", (), (t,))
        assert time.monotonic() - t0 < 0.1 and not reader.done()
        reader._finish(None)
    finally:
        first._finish(None)


def test_overlaps_own_threads_never_wait() -> None:
    t = torch.ones(8)
    first = _pending()
    claims.claim(first, "all_reduce", (t,))
    out: list[float] = []

    def worker() -> None:
        claims.internal_thread()
        t0 = time.monotonic()
        claims.settle("all_reduce", (t,))
        out.append(time.monotonic() - t0)

    th = threading.Thread(target=worker)
    th.start()
    th.join(5)
    try:
        assert out and out[0] < 0.1 and not first.done()
    finally:
        first._finish(None)


def test_a_check_after_many_completed_claims_still_finds_the_live_one() -> None:
    t = torch.ones(8)
    for _ in range(3):  # past the index's rebuild threshold, each claim met once
        hs = [_pending() for _ in range(300)]
        # the claimed tensors kept alive while their handles are pending, as a real op's
        # handle keeps them: freed at once, the allocator gave the settle's torch.ones(1)
        # the address of one of them, and the settle waited for ever on a handle this
        # test finishes only after it (a 300 s timeout in CI, once)
        sent = [torch.ones(2) for _ in hs]
        for h, x in zip(hs, sent, strict=True):
            claims.claim(h, "isend", (), (x,))
        claims.settle("all_reduce", (torch.ones(1),))
        for h in hs:
            h._finish(None)
    first = _pending()
    claims.claim(first, "all_reduce", (t,))
    claims.settle("all_reduce", (torch.ones(1),))  # indexes it
    for _ in range(300):  # more completed claims: the index is rebuilt with it in
        h = _pending()
        claims.claim(h, "isend", (), (torch.ones(2),))
        h._finish(None)
        claims.settle("all_reduce", (torch.ones(1),))
    # t0 before the timer: a wait then lasts >= 0.3 s however this thread is scheduled (the
    # other order failed once in CI, the timer's 0.3 s counted partly before t0)
    t0 = time.monotonic()
    threading.Timer(0.3, first._finish, (None,)).start()
    claims.settle("all_reduce", (t,))
    assert time.monotonic() - t0 > 0.2 and first.done()
    assert len(claims._index) < 10


def test_an_op_issued_from_a_done_callback_never_waits() -> None:
    t = torch.ones(8)
    first, trigger = _pending(), _pending("barrier")
    claims.claim(first, "all_reduce", (t,))
    took: list[float] = []

    def cb(_: Handle) -> None:
        t0 = time.monotonic()
        claims.settle("all_reduce", (t,))  # would wait for ``first`` for good
        took.append(time.monotonic() - t0)

    trigger.add_done_callback(cb)
    trigger._finish(None)
    try:
        assert took and took[0] < 0.1 and not first.done()
    finally:
        first._finish(None)
