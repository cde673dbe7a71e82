"""Rank-side functions for the DESIGN.md §3 contract tests."""

from __future__ import annotations

import asyncio
import gc
import itertools
import threading
import time
import weakref
from typing import Any

import torch

import overlap
from overlap import CommError, CommTimeoutError, comm
from overlap.comm import waiters
from tests.polling import until


def many_in_flight(n: int, loop: str) -> int:
    """n handles in flight at once, gathered; half awaited in reverse issue order."""
    r, w = comm.get_rank(), comm.get_world_size()

    async def main() -> int:
        ts = [torch.full((4,), float(i + r)) for i in range(n)]
        hs = [comm.all_reduce(t, async_op=True) for t in ts]
        half = n // 2
        rev = [await h for h in reversed(hs[half:])]
        first = await asyncio.gather(*hs[:half])
        for i, out in enumerate(first + rev[::-1]):
            assert out.tolist() == [float(i * w + w * (w - 1) / 2)] * 4, (i, out)
        return n

    return overlap.run(main(), loop=loop)  # type: ignore[arg-type]


def cancelled_awaiter(loop: str) -> list[float]:
    r = comm.get_rank()

    async def main() -> list[float]:
        if r == 0:
            buf = torch.zeros(3)
            h = comm.irecv(buf, src=1)
            task = asyncio.ensure_future(h)
            await asyncio.sleep(0.05)
            task.cancel()
            try:
                await task
                raise AssertionError("the cancelled task finished")
            except asyncio.CancelledError:
                pass
            assert not h.done()
            comm.barrier()  # only now may rank 1 send
            out = await h  # the op ran on and still delivers into the same buffer
            assert out is buf
        else:
            comm.barrier()
            await comm.isend(torch.tensor([1.0, 2.0, 3.0]), dst=0)
            out = torch.tensor([1.0, 2.0, 3.0])
        nxt = torch.ones(2)
        await comm.all_reduce(nxt, async_op=True)  # the next op works
        assert nxt.tolist() == [2.0, 2.0]
        return out.tolist()

    return overlap.run(main(), loop=loop)  # type: ignore[arg-type]


def timeout_at_awaiting_side() -> list[float]:
    r = comm.get_rank()
    if r == 0:
        buf = torch.zeros(2)
        h = comm.irecv(buf, src=1)
        try:
            h.wait(timeout=0.2)
            raise AssertionError("wait did not time out")
        except CommTimeoutError as e:
            assert "still in flight" in str(e)

        async def with_wait_for() -> None:
            try:
                await asyncio.wait_for(h, 0.2)
                raise AssertionError("wait_for did not time out")
            except asyncio.TimeoutError:
                pass

        overlap.run(with_wait_for())
        comm.barrier()
        out: list[float] = h.wait(timeout=60).tolist()
    else:
        comm.barrier()
        comm.send(torch.tensor([5.0, 6.0]), dst=0)
        out = [5.0, 6.0]
    t = torch.ones(3)
    comm.all_reduce(t)  # the connection still works after the timed-out waits
    assert t.tolist() == [2.0] * 3
    return out


def handle_keeps_tensors() -> bool:
    r = comm.get_rank()
    if r == 0:
        t = torch.zeros(1000)
        ref = weakref.ref(t)
        h = comm.irecv(t, src=1)
        del t
        gc.collect()
        assert ref() is not None, "the receive buffer was freed while the op was in flight"
        comm.barrier()
        out = h.wait(timeout=60)
        assert out.sum().item() == 1000.0
    else:
        comm.barrier()
        comm.send(torch.ones(1000), dst=0)
    return True


def callbacks_never_block() -> int:
    """With a waiter thread held by a pending irecv, awaited collectives complete from gloo's
    future callbacks: no more waiter threads, nothing blocked behind the receive."""
    r = comm.get_rank()
    saved = waiters._pool
    waiters._pool = waiters.WaiterPool()
    try:
        pending = comm.irecv(torch.zeros(1), src=1) if r == 0 else None
        if pending is not None:
            assert not pending.done()  # starts observing it: the one waiter thread is now busy

        async def burst() -> int:
            hs = [comm.all_reduce(torch.ones(2), async_op=True) for _ in range(50)]
            outs = await asyncio.wait_for(asyncio.gather(*hs), 60)
            assert all(o.tolist() == [2.0, 2.0] for o in outs)
            return len(outs)

        n = overlap.run(burst())
        assert waiters._pool.num_threads == (1 if r == 0 else 0)
        comm.barrier()
        if r == 0:
            assert pending is not None
            pending.wait(timeout=60)
        else:
            comm.send(torch.ones(1), dst=0)
        return n
    finally:
        waiters._pool.shutdown()
        waiters._pool = saved


def a_raising_callback_harms_nothing() -> dict[str, Any]:
    """A done-callback that raises, on a pending collective (gloo: completed from gloo's
    future callback; MPI: from the progress engine), on a pending receive (gloo: a waiter
    thread) and on a done handle (called at once): the other callbacks run, collect_all
    returns, later async ops complete, and the error is logged, never raised at the caller."""
    import logging

    r = comm.get_rank()
    logged: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logged.append(record.getMessage())

    keep = Keep(logging.ERROR)
    logging.getLogger("overlap.comm.handle").addHandler(keep)
    ran: list[str] = []

    def boom(_: Any) -> None:
        raise ZeroDivisionError("a user's callback")

    async def go() -> dict[str, Any]:
        out: dict[str, Any] = {}
        if r == 1:
            time.sleep(0.1)  # rank 0's ops are pending when their callbacks are added
        t = torch.ones(2)
        h = comm.all_reduce(t, async_op=True)
        h.add_done_callback(boom)
        h.add_done_callback(lambda _: ran.append("collective"))
        await asyncio.wait_for(comm.collect_all([h]), 20)
        out["collective"] = t.tolist()
        into = torch.zeros(1)
        if r == 0:
            rh = comm.irecv(into, src=1)
            rh.add_done_callback(boom)
            rh.add_done_callback(lambda _: ran.append("receive"))
            await asyncio.wait_for(rh, 20)
        else:
            time.sleep(0.1)
            comm.send(torch.full((1,), 7.0), dst=0)
        out["received"] = into.item()
        h.add_done_callback(boom)  # done already: called here, and must not raise here
        ts = [torch.full((1,), float(i)) for i in range(4)]
        await asyncio.wait_for(
            comm.collect_all([comm.all_reduce(x, async_op=True) for x in ts]), 20
        )
        out["later"] = [x.item() for x in ts]
        return out

    try:
        out = overlap.run(go())
    finally:
        logging.getLogger("overlap.comm.handle").removeHandler(keep)
    out["ran"] = sorted(ran)
    out["logged"] = sum("a done-callback of" in m and "raised" in m for m in logged)
    return out


def check_raising_callbacks(out: list[dict[str, Any]]) -> None:
    """Both ranks' :func:`a_raising_callback_harms_nothing` (gloo and MPI)."""
    for r, o in enumerate(out):
        assert o["collective"] == [2.0, 2.0] and o["later"] == [0.0, 2.0, 4.0, 6.0], o
        assert o["received"] == (7.0 if r == 0 else 0.0), o
        assert o["ran"] == (["collective", "receive"] if r == 0 else ["collective"]), o
        assert o["logged"] == (3 if r == 0 else 2), o


def loops_are_freed(n: int) -> tuple[int, int]:
    """``n`` event loops (``overlap.run`` per call, as a loop that runs each step so), each
    awaiting ops that are still pending when awaited (the peer issues 3 ms late, past the
    spins): (event loops, anon-inode fds: eventfds and epolls) alive afterwards beyond
    those before. Before the forty-ninth session the waker registry kept every loop that
    awaited a gloo op alive with its eventfd, and the MPI progress engine's kept each loop
    that polled one."""
    import os

    r = comm.get_rank()

    def alive() -> tuple[int, int]:
        gc.collect()
        loops = sum(isinstance(o, asyncio.AbstractEventLoop) for o in gc.get_objects())
        fds = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                fds += os.readlink(f"/proc/self/fd/{fd}").startswith("anon_inode")
            except OSError:
                pass
        return loops, fds

    async def step() -> None:
        if r == 1:
            time.sleep(0.003)
        hs = [comm.all_reduce(torch.ones(2), async_op=True) for _ in range(3)]
        await hs[0]
        await comm.collect_all(hs[1:])

    overlap.run(step())  # whatever is made once per process
    loops0, fds0 = alive()
    for i in range(n):
        overlap.run(step(), loop="asyncio" if i % 2 else "uvloop")
    loops1, fds1 = alive()
    return loops1 - loops0, fds1 - fds0


def futureless_ops_use_waiter_threads() -> bool:
    w = comm.get_world_size()
    out = torch.empty(1)
    h = comm.reduce_scatter(out, torch.ones(w), async_op=True)
    assert h.wait(timeout=60).item() == float(w)
    names = [t.name for t in threading.enumerate()]
    assert any(n.startswith("overlap-waiter") for n in names), names
    return True


def peer_never_sends(loop: str) -> float:
    """Rank 0 times out waiting for a message rank 1 never sends; both then shut down."""
    if comm.get_rank() == 0:

        async def main() -> float:
            t0 = time.monotonic()
            try:
                await asyncio.wait_for(comm.irecv(torch.zeros(1), src=1), 0.5)
            except asyncio.TimeoutError:
                return time.monotonic() - t0
            raise AssertionError("no timeout")

        return overlap.run(main(), loop=loop)  # type: ignore[arg-type]
    return 0.0


def peer_dies_mid_op() -> Any:
    """Rank 1 exits abruptly; rank 0's awaited receive fails with CommError (cause kept)."""
    if comm.get_rank() == 1:
        threading.Timer(0.3, lambda: __import__("os")._exit(0)).start()
        return "exiting"

    async def main() -> Any:
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(comm.irecv(torch.zeros(1), src=1), 60)
        except CommError as e:
            return ["CommError", type(e.__cause__).__name__, str(e), time.monotonic() - t0]
        raise AssertionError("no error")

    return overlap.run(main())


def dropped_handle_still_completes() -> list[float]:
    """A pending handle that the user drops is observed to the end; its buffer is filled."""
    r = comm.get_rank()
    if r == 0:
        buf = torch.zeros(3)
        comm.irecv(buf, src=1)  # the Handle is dropped at once
        gc.collect()
        comm.barrier()
        assert until(lambda: buf.sum().item() == 6.0, 30, every=0.01), buf.tolist()
        done = comm.all_reduce(torch.ones(1), async_op=True)
        ref = weakref.ref(done)
        done.wait()
        del done
        assert ref() is None, "a completed handle is kept alive by a reference cycle"
        return buf.tolist()
    comm.barrier()
    comm.send(torch.tensor([1.0, 2.0, 3.0]), dst=0)
    comm.all_reduce(torch.ones(1))
    return [1.0, 2.0, 3.0]


def awaited_ops_spin_on_an_idle_loop() -> list[bool]:
    """An awaited gloo op is polled on the loop's thread for up to ``waiters.SPIN_S`` when
    nothing else is observed: a collective and a receive whose peer is 0.3 s late complete
    inside ``on_await`` (no future made), a short spin gives up in time, and no spin runs
    while another op of the process is in flight. Returns rank 0's observations."""
    r = comm.get_rank()
    saved = waiters.SPIN_S
    seen: list[bool] = []

    async def issue_late(spin: float, make: Any) -> tuple[Any, float]:
        waiters.SPIN_S = spin
        comm.barrier()
        if r == 1:
            time.sleep(0.3)
        h = make()
        t0 = time.perf_counter()
        h._engine.on_await(h, asyncio.get_running_loop())
        return h, time.perf_counter() - t0

    async def main() -> None:
        t = torch.ones(2)
        # 1. a collective completes within a long spin
        h, _ = await issue_late(30.0, lambda: comm.all_reduce(t, async_op=True))
        seen.append(h.done())
        assert (await h).tolist() == [2.0, 2.0]
        # 2. so does a receive (no future: a pool thread waits, the loop polls the handle)
        buf = torch.zeros(2)
        h, _ = await issue_late(
            30.0,
            lambda: comm.irecv(buf, src=1) if r == 0 else comm.isend(torch.full((2,), 3.0), dst=0),
        )
        seen.append(h.done())
        await h
        assert r == 1 or buf.tolist() == [3.0, 3.0]
        # 3. a short spin gives up in time; the op then completes through its engine
        h, dt = await issue_late(0.05, lambda: comm.all_reduce(t, async_op=True))
        seen.append(not h.done() and dt < 0.25)
        assert (await h).tolist() == [4.0, 4.0]
        # 4. no spin while another op is observed (rank 0: a receive rank 1 sends last)
        other = comm.irecv(torch.zeros(1), src=1) if r == 0 else None
        if other is not None:
            assert not other.done()  # observed from now on
        h, dt = await issue_late(30.0, lambda: comm.all_reduce(t, async_op=True))
        seen.append(not h.done() and dt < 0.25)
        assert (await h).tolist() == [8.0, 8.0]
        if other is not None:
            await other
        else:
            await comm.isend(torch.ones(1), dst=0)
        # 5. an op of more bytes than any window could see complete (waiters.SPIN_BYTES)
        # is not spun on, however long the window: it goes straight to its engine
        big = torch.ones(int(waiters.SPIN_BYTES) // 4 + 1)
        h, dt = await issue_late(30.0, lambda: comm.all_reduce(big, async_op=True))
        seen.append(not h.done() and dt < 0.25)
        assert bool((await h).eq(2.0).all())

    try:
        overlap.run(main())
    finally:
        waiters.SPIN_S = saved
    return seen if r == 0 else []


def blocking_ops_poll_only_what_a_window_can_see_complete() -> list[float]:
    """A blocking gloo collective polls its Work before it sleeps (waiters.poll_first), for
    up to ``waiters.SPIN_S``, but not when it moves more bytes than the window could see
    complete (``waiters.SPIN_BYTES``): there the poll only took the CPU that gloo's threads
    needed. Rank 1 joins 0.3 s late with a 0.2 s window; returns rank 0's thread CPU
    seconds for a small all_reduce (polled: about the window) and a large one (not)."""
    r = comm.get_rank()
    saved = waiters.SPIN_S
    cpu: list[float] = []
    waiters.SPIN_S = 0.2
    try:
        for n in (2, int(waiters.SPIN_BYTES) // 4 + 1):
            t = torch.ones(n)
            comm.barrier()
            if r == 1:
                time.sleep(0.3)
            c0 = time.thread_time()
            comm.all_reduce(t)
            cpu.append(time.thread_time() - c0)
            assert bool(t.eq(2.0).all())
    finally:
        waiters.SPIN_S = saved
    return cpu if r == 0 else []


def collect_all_spins_share_one_window() -> float:
    """The ops of one ``collect_all`` share one spin window (overlap.comm.spin): rank 0
    awaits 20 all_reduces that the other ranks issue 40 ms apart, with a 100 ms window. Each
    op alone would complete inside its own window, so without the shared bound the loop was
    held for all of them (about 0.8 s) in one callback. Twice: observed through its engine,
    and awaited with another task on the loop (the longest gap between that task's turns;
    on MPI the await's own tight loop, then the engine with no second spin). Any backend
    (gloo and MPI). Returns the longest rank 0's loop was held."""
    from overlap.comm import progress

    r = comm.get_rank()
    saved = waiters.SPIN_S, progress.SPIN_S
    held = 0.0

    async def gap_while(aw: Any) -> float:
        """The longest the loop went without running another task while ``aw`` ran."""
        marks: list[float] = []
        stop = False

        async def tick() -> None:
            while not stop:
                marks.append(time.perf_counter())
                await asyncio.sleep(0)

        task = asyncio.ensure_future(tick())
        await asyncio.sleep(0)
        try:
            await asyncio.wait_for(aw, 60)
        finally:
            stop = True
            await task
        return max(b - a for a, b in itertools.pairwise(marks))

    async def main() -> None:
        nonlocal held
        w = comm.get_world_size()
        for way in ("observed", "awaited"):
            ts = [torch.full((2,), float(i)) for i in range(20)]
            comm.barrier()
            if r == 0:
                whole = comm.collect_all([comm.all_reduce(t, async_op=True) for t in ts])
                if way == "observed":
                    t0 = time.perf_counter()
                    whole._engine.on_await(whole, asyncio.get_running_loop())
                    took = time.perf_counter() - t0
                    await asyncio.wait_for(whole, 60)
                else:
                    # awaited as users do: on MPI these are all the process's open ops,
                    # the case collect_all's own tight loop takes (progress.spin_together)
                    took = await gap_while(whole)
                held = max(held, took)
            else:
                hs = []
                for t in ts:
                    hs.append(comm.all_reduce(t, async_op=True))
                    time.sleep(0.04)
                for h in hs:
                    h.wait(60)
            assert [t.tolist() for t in ts] == [[float(i * w)] * 2 for i in range(20)]

    waiters.SPIN_S = progress.SPIN_S = 0.1
    try:
        overlap.run(main())
    finally:
        waiters.SPIN_S, progress.SPIN_S = saved
    # under two windows: an await that spun its window and then spun again in the engine
    # held the loop two windows (0.100 s with a 0.05 s window: MPI, measured)
    assert held < 0.17, f"one collect_all held the loop {held:.3f} s; its window is 0.1 s"
    return held


def run_takes_handles() -> list[list[float]]:
    """``overlap.run(h)`` and ``overlap.run(comm.collect_all(...))`` await the handles, where
    asyncio.run refused them and left the ops in flight (found by a differential fuzz)."""
    r, w = comm.get_rank(), comm.get_world_size()
    t = torch.full((3,), float(r + 1))
    got = overlap.run(comm.all_reduce(t, async_op=True))
    out = torch.zeros(3)
    hs = [comm.irecv(out, src=(r - 1) % w), comm.isend(t, dst=(r + 1) % w)]
    overlap.run(comm.collect_all(hs))
    return [got.tolist(), out.tolist()]


def collect_all_hands_off_together(big_send: bool = False) -> list[float]:
    """An awaited ``collect_all`` of gloo ops with no future (a receive and a send) hands
    every op to a waiter thread before the loop spins on any (waiters.start_together):
    rank 1 posts its receive at once and sends 0.5 s later, rank 0 awaits its receive and
    its send together with a 0.3 s window. The send completes at once; before, the loop
    spun on the receive for the whole window before the send was handed off, and the send
    completed 0.3 s late. ``big_send``: the send is larger than any window could see
    complete (waiters.SPIN_BYTES), and the pair is still handed off together (with no
    spin). Returns rank 0's (send done, receive done) in seconds after the posts."""
    r = comm.get_rank()
    saved = waiters.SPIN_S
    out: list[float] = []
    n = int(waiters.SPIN_BYTES) // 4 + 1 if big_send else 2

    async def main() -> None:
        comm.barrier()
        if r == 0:
            t0 = time.perf_counter_ns()
            got, send = torch.zeros(2), torch.full((n,), 5.0)
            hs = [comm.irecv(got, src=1), comm.isend(send, dst=1)]
            await asyncio.wait_for(comm.collect_all(hs), 30)
            out.append((hs[1].end_ns - t0) / 1e9)
            out.append((hs[0].end_ns - t0) / 1e9)
            assert got.tolist() == [7.0, 7.0]
        else:
            got = torch.zeros(n)
            h = comm.irecv(got, src=0)
            time.sleep(0.5)
            comm.isend(torch.full((2,), 7.0), dst=0).wait(30)
            h.wait(30)
            assert bool(got.eq(5.0).all())

    waiters.SPIN_S = 0.3
    try:
        overlap.run(main())
    finally:
        waiters.SPIN_S = saved
    return out


def p2p_last_call(blocking: bool = False) -> str:
    """isend/irecv seen before post again with no check repeated but those that can change
    (gloo: TorchBackend._last_p2p; MPI: the last ready call, tests/mpi/ready_calls.py): the
    same values, senders and errors as the full path, and nothing changed since gets
    through. ``blocking``: the exchanges are blocking ``send`` and ``recv``, which post the
    same kept calls with no Handle. Two ranks, gloo or MPI; returns "ok"."""
    from overlap.comm import state
    from tests.gloo.catching import catcher

    r = comm.get_rank()
    peer = 1 - r
    backend = state.active()
    raised: dict[str, str] = {}
    catch = catcher(raised)
    o, s = torch.zeros(4), torch.zeros(4)

    def swap(value: float, tag: int = 0, src: int | None = peer, group: object = None) -> int:
        s.fill_(value + r)
        first = r == 0  # a pair whose orders differ, as a pipeline's stages send
        if blocking:
            got = comm.recv(o, src=src, tag=tag, group=group) if first else None
            comm.send(s, dst=peer, tag=tag, group=group)
            if got is None:
                got = comm.recv(o, src=src, tag=tag, group=group)
            assert got == peer, got
            return len(o)
        h = comm.irecv(o, src=src, tag=tag, group=group) if first else None
        comm.isend(s, dst=peer, tag=tag, group=group).wait(30)
        if h is None:
            h = comm.irecv(o, src=src, tag=tag, group=group)
        h.wait(30)
        assert h.source == peer, h.source
        return len(o)

    for i in range(3):
        swap(float(i))
        assert torch.equal(o, torch.full((4,), float(i + peer))), (i, o)
    assert backend._last_send is not None and backend._last_send[0]() is s, "no last send"
    assert backend._last_recv is not None and backend._last_recv[0]() is o, "no last receive"
    # the last receive's object with another tag, while a receive of its tag waits: each
    # message lands where its tag says
    p = torch.zeros(4)
    h9, h0 = comm.irecv(o, src=peer, tag=9), comm.irecv(p, src=peer, tag=0)
    comm.isend(torch.full((4,), 1.0), dst=peer, tag=0).wait(30)
    comm.isend(torch.full((4,), 9.0), dst=peer, tag=9).wait(30)
    h9.wait(30)
    h0.wait(30)
    assert o.tolist() == [9.0] * 4 and p.tolist() == [1.0] * 4, (o, p)
    swap(20.0, tag=7)  # another tag: lands on the tag the call names
    swap(21.0, tag=7)
    assert torch.equal(o, torch.full((4,), 21.0 + peer)), o
    swap(30.0, src=None)  # any source (never kept), then the peer again
    swap(31.0)
    assert torch.equal(o, torch.full((4,), 31.0 + peer)), o
    g3 = comm.new_group([0, 1])
    swap(40.0, group=g3)  # another group object: its own calls
    swap(41.0, group=g3)
    assert torch.equal(o, torch.full((4,), 41.0 + peer)), o
    comm.destroy_process_group(g3)
    assert backend._last_send is None and backend._last_recv is None, "a destroyed group's"
    swap(50.0)
    swap(51.0)
    # the last calls' objects with a destroyed group, or this rank as the peer: the full
    # path's errors, nothing posted
    catch("destroyed", lambda: comm.isend(s, dst=peer, group=g3))
    catch("to_self", lambda: comm.isend(s, dst=r))
    catch("from_self", lambda: comm.irecv(o, src=r))
    catch("send_destroyed", lambda: comm.send(s, dst=peer, group=g3))
    catch("send_to_self", lambda: comm.send(s, dst=r))
    catch("recv_from_self", lambda: comm.recv(o, src=r))
    for name in ("destroyed", "to_self", "from_self", "send_destroyed", "send_to_self",
                 "recv_from_self"):  # fmt: skip
        assert raised[name].startswith("ValueError"), raised
    # another tensor object, of the last call's dtype and contiguous but not on the CPU:
    # the full path's check names it (the memo's object stands for what one object cannot
    # change: its device and layout)
    catch("meta", lambda: comm.isend(torch.zeros(4, device="meta"), dst=peer))
    assert raised["meta"].startswith("ValueError") and "meta" in raised["meta"], raised
    for name, x, call in (
        ("last_recv_t_", o, lambda: comm.irecv(o, src=peer)),
        ("last_send_t_", s, lambda: comm.isend(s, dst=peer)),
        ("recv_t_", o, lambda: comm.recv(o, src=peer)),
        ("send_t_", s, lambda: comm.send(s, dst=peer)),
    ):
        x.resize_(2, 2)
        x.t_()  # the same object, address and bytes, not contiguous: refused, nothing posted
        catch(name, call)
        assert raised[name].startswith("ValueError") and "contiguous" in raised[name], raised
        x.t_()
        x.resize_(4)
    swap(52.0)
    assert torch.equal(o, torch.full((4,), 52.0 + peer)), o
    s.resize_(2)  # the same objects, fewer bytes: 2 elements each way
    o.resize_(2)
    assert swap(60.0) == 2 and torch.equal(o, torch.full((2,), 60.0 + peer)), o
    swap(61.0)
    o.set_(torch.zeros(2).untyped_storage())  # the same object at another address
    before = o.data_ptr()
    swap(70.0)
    assert o.data_ptr() == before and torch.equal(o, torch.full((2,), 70.0 + peer)), o
    o.requires_grad_(True)  # the full path detaches it; the values still land
    swap(80.0)
    o.requires_grad_(False)
    assert torch.equal(o, torch.full((2,), 80.0 + peer)), o
    swap(81.0)
    saved = s.data
    s.data = torch.zeros(1, dtype=torch.int32)  # the same object, another dtype, 4 bytes
    o.data = torch.zeros(1, dtype=torch.int32)
    s.fill_(90 + r)
    h = comm.irecv(o, src=peer) if r == 0 else None
    comm.isend(s, dst=peer).wait(30)
    (h or comm.irecv(o, src=peer)).wait(30)
    assert o.dtype == torch.int32 and o.tolist() == [90 + peer], o
    if comm.get_backend() == "gloo":
        # same address and bytes, a dtype gloo lacks: not the memo's post (gloo would refuse
        # the raw uint16), the full path, which sends its bytes
        s.data = s.data.view(torch.uint16)
        o.data = torch.zeros(2, dtype=torch.uint16)
        h = comm.irecv(o, src=peer) if r == 0 else None
        comm.isend(s, dst=peer).wait(30)
        (h or comm.irecv(o, src=peer)).wait(30)
        assert o.view(torch.int32).tolist() == [90 + peer], o
    s.data = saved
    comm.barrier()
    return "ok"
