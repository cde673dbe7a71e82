"""Handle semantics, driven by a thread standing in for a backend (no torch.distributed)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch

from overlap import CommError, CommTimeoutError
from overlap.comm.handle import Handle, HandleState
from tests.conftest import LOOP_KINDS


def finish_later(h: Handle, delay: float, exc: BaseException | None = None) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(delay), h._finish(exc)))
    t.start()
    return t


def test_completed_handle() -> None:
    h = Handle.completed("all_reduce", [1, 2], nbytes=8)
    assert h.done() and h.state is HandleState.DONE
    assert h.wait() == [1, 2] and h.result() == [1, 2] and h.exception() is None
    assert h.end_ns is not None and h.end_ns >= h.start_ns


def test_wait_without_a_loop_and_with_timeout() -> None:
    h = Handle("irecv", result="payload", nbytes=1 << 20, group="world", backend="gloo")
    assert "irecv 1.0 MiB group=world backend=gloo state=pending" in repr(h)
    with pytest.raises(CommTimeoutError, match="still in flight"):
        h.wait(timeout=0.05)
    assert not h.done()  # the timeout cancelled the wait, not the op
    finish_later(h, 0.05)
    assert h.wait(timeout=5) == "payload"
    assert "state=done" in repr(h)


def test_wait_takes_a_timedelta_and_inf_and_refuses_nonsense_clearly() -> None:
    """Before: inf raised OverflowError ("timestamp out of range for platform time_t"), NaN
    "Invalid value NaN", "1" a comparison's TypeError, and -1 a CommTimeoutError that the op
    "did not complete within -1 s"."""
    import datetime
    import math

    h = Handle("irecv", result="payload", group="world", backend="gloo")
    for bad, kind in ((float("nan"), ValueError), (-1, ValueError), ("1", TypeError)):
        with pytest.raises(kind, match=r"^timeout "):
            h.wait(timeout=bad)
    with pytest.raises(CommTimeoutError, match=r"within 0\.05 s"):
        h.wait(timeout=datetime.timedelta(milliseconds=50))
    assert not h.done()  # none of that touched the op
    finish_later(h, 0.05)
    assert h.wait(timeout=math.inf) == "payload"
    assert h.wait(timeout=0) == "payload"  # 0 polls


def test_pending_result_and_exception_refuse() -> None:
    h = Handle("barrier", result=None)
    with pytest.raises(asyncio.InvalidStateError, match="still in flight"):
        h.result()
    with pytest.raises(asyncio.InvalidStateError):
        h.exception()
    h._finish(None)


def test_is_completed_is_done_under_torchs_name() -> None:
    # code written for torch.distributed's Work polls is_completed(); it raised AttributeError
    h = Handle("all_reduce", result=None)
    assert h.is_completed() is False
    h._finish(CommError("failed"))
    assert h.is_completed() is True  # failed counts as completed, as torch's does
    assert Handle.completed("barrier", None).is_completed() is True


def test_get_future_is_a_torch_future_of_the_ops_tensors() -> None:
    # torch Work's get_future(): DDP comm hooks return all_reduce(...).get_future().then(...)
    t = torch.ones(2)
    h = Handle("all_reduce", result=t)
    fut = h.get_future()
    assert isinstance(fut, torch.futures.Future) and not fut.done()
    halved = fut.then(lambda f: f.value()[0] / 2)
    h._finish(None)
    assert fut.value() == [t] and fut.value()[0] is t
    assert torch.equal(halved.wait(), torch.full((2,), 0.5))
    assert Handle.completed("barrier", None).get_future().wait() == []  # done: at once
    outs = [torch.zeros(1), torch.ones(1)]
    assert Handle.completed("all_gather", outs).get_future().value() is outs
    failed = Handle("all_reduce", result=t)
    fut = failed.get_future()
    err = CommError("peer gone")
    failed._finish(err)
    with pytest.raises(CommError, match="peer gone"):
        fut.wait()


def test_torch_work_names_source_rank_is_success_synchronize() -> None:
    # torch Work's source_rank(), is_success(), synchronize() and block_current_stream()
    recv = Handle("irecv", result="buf")
    recv._source = 3
    with pytest.raises(RuntimeError, match="still in flight"):
        recv.source_rank()
    assert not recv.is_success()  # torch's says True here: "no error yet"
    finish_later(recv, 0.02)
    recv.synchronize()
    assert recv.done() and recv.is_success() and recv.source_rank() == 3
    with pytest.raises(RuntimeError, match="not a receive"):
        Handle.completed("all_reduce", None).source_rank()
    failed = Handle("irecv", result=None)
    failed._source = 1
    failed._finish(CommError("peer gone"))
    assert not failed.is_success()
    with pytest.raises(RuntimeError, match="failed"):
        failed.source_rank()
    with pytest.raises(CommError, match="peer gone"):
        failed.synchronize()
    with pytest.raises(CommError, match="peer gone"):
        failed.block_current_stream()


def test_failure_reaches_waiter_with_cause() -> None:
    h = Handle("all_reduce", result=None)
    cause = RuntimeError("Connection closed by peer")
    err = CommError("all_reduce failed")
    err.__cause__ = cause
    finish_later(h, 0.01, err)
    with pytest.raises(CommError) as info:
        h.wait(timeout=5)
    assert info.value.__cause__ is cause
    assert h.exception() is err and h.state is HandleState.FAILED


def test_a_raising_callback_is_logged_and_the_others_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    h = Handle("all_reduce", result=1, nbytes=4)
    ran: list[str] = []
    h.add_done_callback(lambda _: ran.append("first"))
    h.add_done_callback(lambda _: 1 / 0)
    h.add_done_callback(lambda _: ran.append("third"))
    with caplog.at_level("ERROR", logger="overlap.comm.handle"):
        h._finish(None)  # a backend thread's call: it must not see the callback's error
        h.add_done_callback(lambda _: 1 / 0)  # done already: called here, and logged
    assert ran == ["first", "third"] and h.wait() == 1
    assert [r.exc_info[0] for r in caplog.records if r.exc_info] == [ZeroDivisionError] * 2


def test_a_handle_refuses_pickling_with_what_to_pickle_instead() -> None:
    import copy
    import pickle

    h = Handle("all_reduce", result=1, nbytes=4)
    for attempt in (pickle.dumps, copy.copy):
        with pytest.raises(TypeError, match=r"all_reduce in flight .* Pickle what h\.wait"):
            attempt(h)


def test_finish_is_idempotent_and_callbacks_run_once() -> None:
    h = Handle("x", result=1)
    seen: list[Handle] = []
    h.add_done_callback(seen.append)
    h._finish(None)
    h._finish(RuntimeError("late"))
    assert seen == [h] and h.result() == 1
    h.add_done_callback(seen.append)  # already done: runs at once
    assert seen == [h, h]


def test_keep_released_at_completion() -> None:
    h = Handle("x", result=1, keep=["buffers"])
    assert h._keep == ["buffers"]
    h._finish(None)
    assert h._keep is None


@pytest.mark.asyncio
async def test_await_resolves_from_another_thread() -> None:
    h = Handle("all_reduce", result="r")
    finish_later(h, 0.02)
    assert await h == "r"
    assert await h == "r"  # awaiting again returns the result again


@pytest.mark.asyncio
async def test_await_does_not_block_the_loop() -> None:
    h = Handle("all_reduce", result="r")
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while not h.done():
            ticks += 1
            await asyncio.sleep(0.001)

    finish_later(h, 0.1)
    out, _ = await asyncio.gather(h, ticker())
    assert out == "r" and ticks >= 10


@pytest.mark.asyncio
async def test_gather_wait_for_as_completed() -> None:
    hs = [Handle("op", result=i) for i in range(50)]
    for i, h in enumerate(reversed(hs)):
        finish_later(h, 0.001 * i)
    assert await asyncio.gather(*hs) == list(range(50))
    hs2 = [Handle("op", result=i) for i in range(5)]
    for h in hs2:
        finish_later(h, 0.01)
    got = sorted([await f for f in asyncio.as_completed(hs2)])
    assert got == list(range(5))
    slow = Handle("op", result="slow")
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(slow, 0.05)
    assert not slow.done()
    finish_later(slow, 0.01)
    assert await slow == "slow"


@pytest.mark.asyncio
async def test_cancelled_awaiter_leaves_the_op_alone() -> None:
    h = Handle("irecv", result="data", keep=["buf"])
    task = asyncio.ensure_future(h)
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not h.done() and h._keep == ["buf"] and h._waiters == []
    finish_later(h, 0.01)
    assert await h == "data"


@pytest.mark.asyncio
async def test_failure_raises_at_await() -> None:
    h = Handle("all_reduce", result=None)
    finish_later(h, 0.01, CommError("boom"))
    with pytest.raises(CommError, match="boom"):
        await h


def test_awaited_from_two_loops_in_two_threads() -> None:
    from overlap.runtime import new_event_loop

    h = Handle("op", result=7)
    results: list[int] = []

    def in_thread(kind: str) -> None:
        loop = new_event_loop(kind)  # type: ignore[arg-type]

        async def main() -> int:
            return int(await h)

        results.append(loop.run_until_complete(main()))
        loop.close()

    threads = [threading.Thread(target=in_thread, args=(k,)) for k in ("uvloop", "asyncio")]
    for t in threads:
        t.start()
    time.sleep(0.05)
    h._finish(None)
    for t in threads:
        t.join(5)
    assert results == [7, 7]


async def _awaits_at_once(h: Handle, seconds: float) -> tuple[int, int]:
    """Await ``h`` (already complete) for ``seconds`` while another task counts its turns:
    (the other task's turns, the awaits)."""
    turns = 0

    async def other() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(other())
    end, n = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        assert await h == "done"
        n += 1
    task.cancel()
    return turns, n


@pytest.mark.parametrize("loop_kind", LOOP_KINDS)
def test_awaits_that_complete_at_once_still_let_the_loop_run(loop_kind: str) -> None:
    """An await of a completed handle returns at once (as on a done asyncio future), and a
    gloo or MPI op awaited on an idle loop often completes inside the await (the spin); a
    coroutine made only of such awaits never let its loop run: no other task, no timeout,
    no Ctrl-C until it ended. Now the loop runs once per 10 ms of them."""
    from overlap.runtime import run

    h = Handle.completed("all_reduce", "done")
    turns, n = run(_awaits_at_once(h, 0.3), loop=loop_kind)  # type: ignore[arg-type]
    assert n > 100 and 5 <= turns <= n // 10, (turns, n)


@pytest.mark.parametrize("loop_kind", LOOP_KINDS)
def test_a_timeout_around_awaits_that_complete_at_once_fires(loop_kind: str) -> None:
    from overlap.runtime import run

    async def main() -> float:
        h = Handle.completed("all_reduce", "done")
        start = time.perf_counter()

        async def spin() -> None:
            while time.perf_counter() - start < 5:
                await h

        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(spin(), 0.05)
        return time.perf_counter() - start

    took = run(main(), loop=loop_kind)  # type: ignore[arg-type]
    assert took < 1.0, took


def test_ctrl_c_ends_a_loop_of_awaits_that_complete_at_once(tmp_path: Path) -> None:
    """One Ctrl-C (SIGINT) ends ``overlap.run`` at once; before, it took a second one."""
    import subprocess
    import sys

    script = tmp_path / "ctrl_c.py"
    script.write_text(
        "import os, signal, threading, time\n"
        "import overlap\n"
        "from overlap.comm.handle import Handle\n"
        "async def main():\n"
        "    h = Handle.completed('all_reduce', 1)\n"
        "    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()\n"
        "    end = time.perf_counter() + 20\n"
        "    while time.perf_counter() < end:\n"
        "        await h\n"
        "    print('not interrupted', flush=True)\n"
        "overlap.run(main())\n"
    )
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert "not interrupted" not in done.stdout
    assert done.returncode != 0 and "KeyboardInterrupt" in done.stderr, done
    assert time.perf_counter() - start < 15, "the Ctrl-C was not taken at once"
