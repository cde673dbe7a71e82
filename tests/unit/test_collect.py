"""collect_all: one Handle for several, driven by threads standing in for a backend."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from overlap import CommError, CommTimeoutError
from overlap.comm import collect_all
from overlap.comm import hooks as _hooks
from overlap.comm.handle import Handle, HandleState


def finish_later(h: Handle, delay: float, exc: BaseException | None = None) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(delay), h._finish(exc)))
    t.start()
    return t


def test_results_in_order_whatever_the_completion_order() -> None:
    hs = [Handle("irecv", result=i, nbytes=4, backend="gloo") for i in range(20)]
    threads = [finish_later(h, 0.002 * (20 - i)) for i, h in enumerate(hs)]
    whole = collect_all(hs)
    assert whole.wait(timeout=5) == list(range(20))
    assert whole.state is HandleState.DONE and whole.nbytes == 80 and whole.backend == "gloo"
    for t in threads:
        t.join()


def test_empty_and_done_handles_complete_at_once() -> None:
    assert collect_all([]).wait(timeout=0) == []
    done = [Handle.completed("x", "a"), Handle.completed("y", "b")]
    assert collect_all(iter(done)).wait(timeout=0) == ["a", "b"]


def test_bad_arguments_name_the_fix() -> None:
    h = Handle.completed("x", 1)
    with pytest.raises(TypeError, match=r"a list of Handles, not one Handle.*collect_all\(\[h1"):
        collect_all(h)
    with pytest.raises(TypeError, match="item 1 is Tensor"):
        import torch

        collect_all([h, torch.ones(1)])  # type: ignore[list-item]


def test_wait_times_out_and_leaves_the_ops_alone() -> None:
    a, b = Handle("irecv", result="a", keep=["buf"]), Handle("isend", result="b")
    whole = collect_all([a, b])
    a._finish(None)
    with pytest.raises(CommTimeoutError, match="still in flight"):
        whole.wait(timeout=0.05)
    assert not b.done() and not whole.done()
    finish_later(b, 0.01)
    assert whole.wait(timeout=5) == ["a", "b"]


def test_fails_with_the_first_failure_and_the_others_run_on() -> None:
    slow = Handle("irecv", result="late", keep=["buf"])
    bad = Handle("isend", result=None)
    err = CommError("isend failed: Connection closed by peer")
    whole = collect_all([slow, bad])
    seen: list[Handle] = []
    whole.add_done_callback(seen.append)  # watched: fails as soon as `bad` does
    bad._finish(err)
    assert whole.state is HandleState.FAILED and whole.exception() is err and seen == [whole]
    with pytest.raises(CommError, match="Connection closed") as info:
        whole.wait(timeout=0)
    assert info.value is err
    assert not slow.done() and slow._keep == ["buf"]  # the other op keeps its tensors
    slow._finish(None)
    assert slow.wait(timeout=0) == "late" and whole.exception() is err and seen == [whole]


def test_wait_in_order_stops_at_a_failure() -> None:
    a, b, c = Handle("x", result=1), Handle("y"), Handle("z")
    a._finish(CommError("a failed"))
    with pytest.raises(CommError, match="a failed"):
        collect_all([a, b, c]).wait(timeout=5)  # not blocked on b or c


def test_not_reported_to_the_tracer_its_ops_are() -> None:
    calls: list[str] = []

    def observer(op: str, *_: Any) -> None:
        calls.append(op)

    previous = _hooks.set_observer(observer)
    try:
        hs = [Handle("irecv", result=1), Handle("isend", result=2)]
        whole = collect_all(hs)
        for h in hs:
            h._finish(None)
        assert whole.wait(timeout=1) == [1, 2]
    finally:
        _hooks.set_observer(previous)
    assert calls == ["irecv", "isend"]


def test_dropped_while_pending_counts_its_handles_down_once() -> None:
    hs = [Handle("x", result=i) for i in range(3)]
    whole = collect_all(hs)
    seen: list[Any] = []
    whole.add_done_callback(lambda w: seen.append(w.result()))
    whole.done()
    whole.done()  # starting twice must not count a handle twice
    hs[0]._finish(None)
    hs[1]._finish(None)
    assert not whole.done()
    hs[2]._finish(None)
    assert seen == [[0, 1, 2]]


@pytest.mark.asyncio
async def test_awaited_one_wake_up_for_all() -> None:
    hs = [Handle("op", result=i) for i in range(50)]
    for i, h in enumerate(reversed(hs)):
        finish_later(h, 0.001 * i)
    assert await collect_all(hs) == list(range(50))
    nested = collect_all([collect_all(hs[:2]), hs[2]])
    assert await nested == [[0, 1], 2]


@pytest.mark.asyncio
async def test_timeout_and_cancel_end_the_wait_not_the_ops() -> None:
    a, b = Handle("irecv", result="a", keep=["buf"]), Handle("isend", result="b")
    whole = collect_all([a, b])
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(whole, 0.05)
    assert not a.done() and a._keep == ["buf"] and whole._waiters == []
    task = asyncio.ensure_future(whole)
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    finish_later(a, 0.01)
    finish_later(b, 0.02)
    assert await whole == ["a", "b"]


@pytest.mark.asyncio
async def test_failure_raises_at_await_without_waiting_for_the_rest() -> None:
    slow, bad = Handle("irecv"), Handle("isend")
    finish_later(bad, 0.01, CommError("boom"))
    with pytest.raises(CommError, match="boom"):
        await asyncio.wait_for(collect_all([slow, bad]), 5)
    assert not slow.done()
    slow._finish(None)
