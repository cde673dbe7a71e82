"""MPI-specific checks, run on every rank under mpiexec by tests/mpi/run_cases.py."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

import overlap
from overlap import comm
from overlap.comm import state
from overlap.comm.progress import ProgressEngine
from tests.gloo.contract_cases import collect_all_spins_share_one_window
from tests.loop_ticks import LoopTicks


def loop_stays_responsive() -> None:
    """Other tasks keep running while a large awaited op progresses (4 MiB x 8 in flight)."""
    w = comm.get_world_size()

    async def main() -> None:
        ts = [torch.ones(1 << 20) for _ in range(8)]
        async with LoopTicks() as ticks:
            outs = await asyncio.gather(*[comm.all_reduce(t, async_op=True) for t in ts])
        assert all(float(o[0]) == w for o in outs)
        assert ticks.count >= 8, f"the loop ran other tasks only {ticks.count} times"
        assert ProgressEngine.for_loop(asyncio.get_running_loop()).in_flight == 0

    overlap.run(main())


def no_thread_per_request() -> None:
    before = threading.active_count()

    async def main() -> None:
        hs = [comm.all_reduce(torch.ones(4), async_op=True) for _ in range(200)]
        assert threading.active_count() == before
        await asyncio.gather(*hs)

    overlap.run(main())
    assert threading.active_count() == before


def zero_copy_cpu_buffers() -> None:
    """The NumPy view MPI receives shares the tensor's memory."""
    from overlap.comm.mpi_backend import _np

    t = torch.arange(4, dtype=torch.float32)
    view = _np(t)
    assert view.ctypes.data == t.data_ptr() and view.nbytes == 16


def dtype_reductions() -> None:
    r, w = comm.get_rank(), comm.get_world_size()
    b = torch.tensor([r == 0, True, False])
    comm.all_reduce(b, op="max")  # logical or
    assert b.tolist() == [True, True, False]
    for dt in (torch.float16, torch.bfloat16):
        t = torch.full((3,), 1.5 + r, dtype=dt)
        comm.all_reduce(t)
        assert t.float().tolist() == [1.5 * w + w * (w - 1) / 2] * 3, (dt, t)
        t2 = torch.full((2,), float(r), dtype=dt)
        comm.all_reduce(t2, op="avg")
        assert t2.float().tolist() == [(w - 1) / 2] * 2
    if not hasattr(torch, "uint16"):  # torch 2.3 and later
        return
    try:
        comm.all_reduce(torch.ones(2, dtype=torch.uint16), op="sum")
        raise AssertionError("uint16 was accepted")
    except TypeError as e:
        assert "MPI cannot reduce torch.uint16" in str(e)


def large_count_refused_without_support() -> None:
    backend = state.active()
    big = torch.empty(2**31, dtype=torch.uint8)  # untouched: no memory is committed
    saved = backend.large_count
    backend.large_count = False
    try:
        comm.broadcast(big, src=0)
        raise AssertionError("a >2 GiB message was accepted without large-count support")
    except ValueError as e:
        assert "above MPI's int count limit" in str(e) and "chunks below 2 GiB" in str(e)
    finally:
        backend.large_count = saved
    assert backend.large_count  # MPICH 5 (MPI-4+): large counts go through mpi4py


def wait_with_timeout_then_complete() -> None:
    r = comm.get_rank()
    if r == 0:
        buf = torch.zeros(2)
        h = comm.irecv(buf, src=1)
        t0 = time.monotonic()
        try:
            h.wait(timeout=0.2)
            raise AssertionError("no timeout")
        except overlap.CommTimeoutError:
            pass
        assert 0.15 < time.monotonic() - t0 < 5
        comm.barrier()
        assert h.wait().tolist() == [7.0, 8.0]
    elif r == 1:
        comm.barrier()
        comm.send(torch.tensor([7.0, 8.0]), dst=0)
    else:
        comm.barrier()


def onebit_gather_pattern_matches_reference() -> None:
    from tests.gloo import compression_cases as cc

    for n in (1, 37, 1001):
        cc.onebit_matches_reference(n, "blocking")
    cc.onebit_matches_reference(100, "uvloop")
    cc.nan_leaves_state_untouched()
    cc.segmented_onebit_is_consistent()


def _pair_rank() -> int | None:
    """This rank, for a check between ranks 0 and 1 that takes one world barrier; the
    others take theirs here and get None."""
    r, w = comm.get_rank(), comm.get_world_size()
    if w < 2 or r > 1:
        comm.barrier()
        return None
    return r


def out_of_order_receive_is_seen() -> None:
    """The progress engine tests the oldest pending requests and a rotating window over the
    rest (overlap.comm.progress): a receive posted behind 100 that never complete still
    completes when its message comes, while the older ones stay pending."""
    r = _pair_rank()
    if r is None:
        return

    async def main() -> None:
        if r == 0:
            bufs = [torch.zeros(1) for _ in range(101)]
            hs = [comm.irecv(bufs[i], src=1, tag=100 + i) for i in range(101)]
            comm.barrier()
            t0 = time.monotonic()
            got = await asyncio.wait_for(hs[-1], 20)  # the newest one's message came first
            assert float(got[0]) == 100.0 and time.monotonic() - t0 < 10
            assert not any(h.done() for h in hs[:-1])
            comm.send(torch.ones(1), dst=1, tag=99)  # now the rest
            outs = await asyncio.wait_for(asyncio.gather(*hs[:-1]), 20)
            assert [float(o[0]) for o in outs] == [float(i) for i in range(100)]
        else:
            comm.barrier()
            comm.send(torch.tensor([100.0]), dst=0, tag=200)
            comm.recv(torch.zeros(1), src=0, tag=99)
            for i in range(100):
                comm.send(torch.tensor([float(i)]), dst=0, tag=100 + i)

    overlap.run(main())


def receive_completed_out_of_order_keeps_its_status() -> None:
    """A receive that the progress engine's Testsome sees complete behind one still pending
    gets its own Status: MPI_Testsome packs the statuses of the completed requests first,
    so the i-th status is the i-th completed request's, not the i-th tested one's. Before,
    the engine read the status at the request's index, an empty one (a message of 0 bytes
    from MPI_ANY_SOURCE), and the receive failed with MessageMismatchError (about one run in
    four of run_cases on 3 ranks; before the size check it only named the wrong sender)."""
    r = _pair_rank()
    if r is None:
        return

    async def main() -> None:
        if r == 0:
            first, second = torch.zeros(2), torch.zeros(3)
            h1 = comm.irecv(first, src=None, tag=31)
            h2 = comm.irecv(second, src=None, tag=32)
            comm.barrier()
            w1 = asyncio.ensure_future(asyncio.wait_for(h1, 20))  # the engine polls h1
            await asyncio.sleep(0.01)
            # the engine's Testsome over [h1, h2] sees h2 alone complete
            try:
                got = await asyncio.wait_for(h2, 20)
                assert got.tolist() == [2.0, 2.0, 2.0] and not h1.done(), (got, h1)
            finally:
                comm.send(torch.ones(1), dst=1, tag=30)  # rank 1 goes on either way
            assert (await w1).tolist() == [1.0, 1.0]
        else:
            comm.barrier()
            time.sleep(0.2)
            comm.send(torch.full((3,), 2.0), dst=0, tag=32)
            comm.recv(torch.zeros(1), src=0, tag=30)
            comm.send(torch.ones(2), dst=0, tag=31)

    overlap.run(main())


def interrupts_never_wedge_the_engine(rounds: int = 3, storm_s: float = 0.4) -> None:
    """KeyboardInterrupts raised on the loop's thread at random points while the progress
    engine polls 16 pending receives (a SIGINT every millisecond, each round's storm
    shorter than the engine's busy phase): afterwards every receive still completes. Before,
    an interrupt raised between a poll's lock acquisition and its release left the op's
    lock held, and every later wait() on that handle hung (3 runs in 8)."""
    r = _pair_rank()
    if r is None:
        return
    n = 16
    for rnd in range(rounds):
        tags = [1000 + 100 * rnd + i for i in range(n)]
        if r == 1:
            comm.recv(torch.zeros(1), src=0, tag=999)
            for i, tag in enumerate(tags):
                comm.send(torch.full((1,), float(i)), dst=0, tag=tag)
            continue
        loop = asyncio.new_event_loop()
        try:
            bufs = [torch.zeros(1) for _ in range(n)]
            hs = [comm.irecv(b, src=1, tag=tag) for b, tag in zip(bufs, tags, strict=True)]
            task = loop.create_task(_gather(hs))  # the engine now polls all 16
            hits = _sigint_storm(loop, storm_s)
            task.cancel()
            loop.run_until_complete(asyncio.wait({task}, timeout=2))
            if not task.done():  # an interrupt landed in asyncio's own bookkeeping (gather's)
                _ABANDONED.append(task)  # kept: no "Task was destroyed" log at collection
        finally:
            loop.close()
        comm.send(torch.ones(1), dst=1, tag=999)
        got = [float(h.wait(timeout=10)[0]) for h in hs]
        assert got == [float(i) for i in range(n)] and hits > 10, (got, hits)
    comm.barrier()


_ABANDONED: list[Any] = []


async def _gather(hs: list[Any]) -> None:
    await asyncio.gather(*hs)


def _sigint_storm(loop: asyncio.AbstractEventLoop, seconds: float) -> int:
    """Run ``loop`` while another thread sends this process SIGINT every millisecond for
    ``seconds``; return how many KeyboardInterrupts the loop raised. Every signal lands
    inside this function: the sender stops when told, and the join catches the last ones
    (a sender that stopped by the clock could be descheduled past the loop's end and
    interrupt the code after it)."""
    import os
    import signal

    pid = os.getpid()
    stop = threading.Event()

    def kick() -> None:
        while not stop.is_set():
            os.kill(pid, signal.SIGINT)
            time.sleep(1e-3)

    hits = 0
    kicker = threading.Thread(target=kick)
    end = time.monotonic() + seconds
    try:
        kicker.start()
    except KeyboardInterrupt:
        hits += 1
    while time.monotonic() < end:
        try:
            loop.run_until_complete(asyncio.sleep(0.02))
        except KeyboardInterrupt:
            hits += 1
    stop.set()
    while True:
        try:
            kicker.join()
            time.sleep(0.05)  # a signal still pending is handled here
            return hits
        except KeyboardInterrupt:
            hits += 1


def collect_all_waits_for_a_late_sender_and_fails_fast() -> None:
    """``await comm.collect_all(...)``: a receive whose sender is 0.8 s late completes through
    the progress engine's ticks and back-off while the loop keeps running other tasks; a
    receive that fails (a message larger than its tensor) fails the whole at once, while the
    other receive stays pending and completes later on its own: listed after the pending
    receive, and before it."""
    r = _pair_rank()
    if r is None:
        return

    async def main() -> None:
        if r == 0:
            late, sent = torch.zeros(2), torch.full((3,), 5.0)
            hs = [comm.irecv(late, src=1, tag=41), comm.isend(sent, dst=1, tag=42)]
            comm.barrier()
            t0 = time.monotonic()
            async with LoopTicks() as ticks:
                out = await asyncio.wait_for(comm.collect_all(hs), 20)
            assert out[0] is late and out[1] is sent and late.tolist() == [4.0, 4.0]
            assert time.monotonic() - t0 > 0.7 and ticks.count > 10, ticks.count
            # the failing receive after the pending one (found by the engine), then before
            # it (found by collect_all's own tight loop, progress.spin_together)
            for first in (False, True):
                small, other = torch.zeros(3), torch.zeros(2)
                bad, pending = comm.irecv(small, src=1, tag=43), comm.irecv(other, src=1, tag=44)
                if first:
                    comm.recv(torch.zeros(1), src=1, tag=46)  # the bad message is sent
                try:
                    both = [bad, pending] if first else [pending, bad]
                    await asyncio.wait_for(comm.collect_all(both), 20)
                    raise AssertionError("no error for a message larger than its receive")
                except overlap.CommError as exc:
                    assert bad.exception() is exc and not pending.done(), (exc, pending)
                finally:
                    comm.send(torch.ones(1), dst=1, tag=45)  # rank 1 goes on either way
                assert (await asyncio.wait_for(pending, 20)).tolist() == [6.0, 6.0]
        else:
            comm.barrier()
            time.sleep(0.8)
            comm.recv(torch.zeros(3), src=0, tag=42)
            comm.send(torch.full((2,), 4.0), dst=0, tag=41)
            for first in (False, True):
                comm.send(torch.ones(4), dst=0, tag=43)
                if first:
                    comm.send(torch.ones(1), dst=0, tag=46)
                comm.recv(torch.zeros(1), src=0, tag=45)
                comm.send(torch.full((2,), 6.0), dst=0, tag=44)

    overlap.run(main())


def backs_off_only_when_nothing_else_is_open() -> None:
    """An awaited receive whose sender waits until told: the progress engine keeps calling
    MPI on every tick while another op of the process is open (MPI moves that op's work
    only inside MPI calls, and the awaited one may wait behind it: awaiting the last of
    4,000 all_reduces first took 10x mpi4py's time when the engine backed off), and backs
    off once nothing else is open."""
    from overlap.comm import progress

    r = _pair_rank()
    if r is None:
        return
    comm.barrier()  # the one the other ranks took in _pair_rank

    async def delay_while_waiting(other_open: bool) -> tuple[float, int]:
        other = comm.irecv(torch.zeros(1), src=1, tag=51) if other_open else None
        h = comm.irecv(torch.zeros(1), src=1, tag=52)
        task = asyncio.ensure_future(h)
        await asyncio.sleep(0.8)  # the engine's back-off starts after 0.5 s without progress
        delay = progress.ProgressEngine.for_loop(asyncio.get_running_loop())._delay
        now_open = progress._open
        comm.send(torch.ones(1), dst=1, tag=50)  # only now does rank 1 send
        await asyncio.wait_for(task, 20)
        if other is not None:
            await asyncio.wait_for(other, 20)
        return delay, now_open

    delays: dict[bool, tuple[float, int]] = {}
    for other_open in (True, False):
        if r == 0:
            delays[other_open] = overlap.run(delay_while_waiting(other_open))
        else:
            comm.recv(torch.zeros(1), src=0, tag=50)
            comm.send(torch.ones(1), dst=0, tag=52)
            if other_open:
                comm.send(torch.ones(1), dst=0, tag=51)
    if r == 0:  # (back-off delay, MPI ops open): with another op open, then without
        assert delays[True][0] == 0.0 and delays[False][0] > 0.0, delays


def tag_above_tag_ub_is_refused() -> None:
    """A tag above MPI_TAG_UB (MPICH: 2**29 - 1, below overlap's own 2**30 limit) is refused
    with a ValueError naming the limit, before anything is posted (MPI said "Invalid tag"
    from inside the op)."""
    ub = state.active().tag_ub
    peer = 1 - comm.get_rank() if comm.get_rank() < 2 else 0
    for call in (
        lambda: comm.isend(torch.ones(1), dst=peer, tag=ub + 1),
        lambda: comm.irecv(torch.ones(1), src=peer, tag=ub + 1),
        lambda: comm.batch_isend_irecv([comm.P2POp("isend", torch.ones(1), peer, tag=ub + 1)]),
    ):
        try:
            call()
            raise AssertionError("a tag above MPI_TAG_UB was accepted")
        except ValueError as e:
            assert f"above this MPI library's largest tag ({ub}, MPI_TAG_UB)" in str(e), e


def lone_await_outlasting_its_spin() -> None:
    """The only MPI op open in the process, awaited (MpiOp.__await__'s written-out common
    case): a peer 30 ms late outlasts the 1 ms spin, so the loop's engine takes the op over
    and the awaiting coroutine is resumed with the reduced tensor; both ops of the pair
    (all_reduce, broadcast) leave nothing open. Under run_cases' job timeout the ops are
    the ready calls' MpiOps with a deadline, as without one."""
    from overlap.comm import progress

    g = comm.new_group([0, 1])  # every rank makes it
    r = _pair_rank()
    if r is None:
        return
    comm.barrier()  # the one the other ranks took in _pair_rank

    async def lone(late: bool) -> tuple[list[float], list[float], list[int]]:
        a, b = torch.full((2,), float(r + 1)), torch.full((3,), float(r + 5))
        if late:
            time.sleep(0.03)
        h = comm.all_reduce(a, group=g, async_op=True)
        opened = [progress._open]
        got = await asyncio.wait_for(h, 20)
        assert got is a, got
        if late:
            time.sleep(0.03)
        h = comm.broadcast(b, src=1, group=g, async_op=True)
        opened.append(progress._open)
        await asyncio.wait_for(h, 20)
        opened.append(progress._open)
        return a.tolist(), b.tolist(), opened

    for _ in range(2):  # the second time through the ready calls
        a, b, opened = overlap.run(lone(late=r == 1))
        assert a == [3.0, 3.0] and b == [6.0, 6.0, 6.0], (a, b)
        # rank 0's ops wait 30 ms for the late rank: open after the post, then awaited; the
        # late rank's may be finished by the test right after the post (_ready_op)
        assert opened == [1, 1, 0] if r == 0 else opened[2] == 0, opened


def freed_requests_complete_on_await() -> None:
    """An op whose request MPI completed (and freed) while its handle stayed pending, as a
    KeyboardInterrupt raised between MPI's completion and overlap's leaves it: awaiting it
    completes it, through the first spin, the loop's tick spin or the engine's batch poll
    (Testsome skips a null request, so that op waited for ever), with the Status that the
    completing Test filled (a receive's sender and size). Where that Status was lost (the
    batch poll fills a list), a receive fails with CommError, not with an empty Status's
    sender (MPI_ANY_SOURCE) and a false size mismatch."""
    from mpi4py import MPI

    from overlap.comm import progress
    from overlap.comm.handle import PENDING

    g = comm.new_group([0, 1])  # every rank makes it
    r = _pair_rank()
    if r is None:
        return
    comm.barrier()  # the one the other ranks took in _pair_rank

    async def awaited(h: Any) -> Any:
        return await asyncio.wait_for(h, 20)

    saved = progress.SPIN_S, progress.TICK_SPIN_S
    try:
        for k, (spin, tick) in enumerate(((saved[0], saved[1]), (0.0, saved[1]), (0.0, 0.0))):
            progress.SPIN_S, progress.TICK_SPIN_S = spin, tick
            if r == 1:
                comm.recv(torch.zeros(1), src=0, tag=60)
                comm.send(torch.full((3,), 5.0 + k), dst=0, tag=61)
                comm.recv(torch.zeros(1), src=0, tag=60)
                comm.send(torch.full((3,), 7.0), dst=0, tag=62)
                comm.all_reduce(torch.full((2,), 1.0), group=g)
                continue
            buf = torch.zeros(3)
            h = comm.irecv(buf, src=1, tag=61)
            comm.send(torch.ones(1), dst=1, tag=60)  # now rank 1 sends
            st = h.status = MPI.Status()  # what a spin does before its Test
            while not h.req.Test(st):  # MPI completes and frees it; the handle stays pending
                pass
            assert h._state is PENDING and not h.req, h
            got = overlap.run(awaited(h))
            assert got.tolist() == [5.0 + k] * 3 and h.source == 1, (k, got, h.source)

            lost = comm.irecv(torch.zeros(3), src=1, tag=62)
            comm.send(torch.ones(1), dst=1, tag=60)
            while not lost.req.Test():  # completed and freed, its Status nowhere
                pass
            try:
                overlap.run(awaited(lost))
                raise AssertionError(f"no error for a receive whose Status was lost ({k})")
            except overlap.CommError as exc:
                assert "sender and size were lost" in str(exc), exc

            t = torch.full((2,), 1.0)
            h3 = comm.all_reduce(t, group=g, async_op=True)
            h3.req.Wait()  # a collective needs no Status
            assert overlap.run(awaited(h3)) is t and t.tolist() == [2.0, 2.0], t
    finally:
        progress.SPIN_S, progress.TICK_SPIN_S = saved


def interrupted_poll_keeps_the_status() -> None:
    """A KeyboardInterrupt raised in the progress engine's poll right after MPI completed a
    receive and before the receive's completion (injected: its first completion raises):
    awaited again on a fresh loop, the receive completes with its sender and values, from
    the Status the poll kept on it. A Testsome filled a list, which the interrupt lost."""
    from overlap.comm import progress
    from overlap.comm.handle import PENDING
    from overlap.comm.mpi_recv import MpiRecv

    r = _pair_rank()
    if r is None:
        return
    comm.barrier()  # the one the other ranks took in _pair_rank
    if r == 1:
        comm.recv(torch.zeros(1), src=0, tag=63)
        comm.send(torch.full((3,), 9.0), dst=0, tag=64)
        return
    buf = torch.zeros(3)
    h = comm.irecv(buf, src=1, tag=64)
    saved = progress.SPIN_S, progress.TICK_SPIN_S
    original = MpiRecv._complete

    def interrupted(self: Any, status: Any) -> None:
        MpiRecv._complete = original  # type: ignore[method-assign]
        raise KeyboardInterrupt

    async def awaited() -> Any:
        return await asyncio.wait_for(h, 20)

    progress.SPIN_S, progress.TICK_SPIN_S = 0.0, 0.0  # only the batch poll tests it
    MpiRecv._complete = interrupted  # type: ignore[method-assign]
    loop = asyncio.new_event_loop()
    try:
        comm.send(torch.ones(1), dst=1, tag=63)  # now rank 1 sends
        try:
            loop.run_until_complete(awaited())
            raise AssertionError("the injected interrupt was not raised")
        except KeyboardInterrupt:
            pass
    finally:
        MpiRecv._complete = original  # type: ignore[method-assign]
        progress.SPIN_S, progress.TICK_SPIN_S = saved
        loop.close()
    assert h._state is PENDING and not h.req, h  # MPI completed it; the handle did not
    got = overlap.run(awaited())
    assert got.tolist() == [9.0] * 3 and h.source == 1, (got, h.source)


CHECKS: dict[str, Callable[[], Any]] = {
    "mpi/tag_above_tag_ub_is_refused": tag_above_tag_ub_is_refused,
    "mpi/collect_all_spins_share_one_window": collect_all_spins_share_one_window,
    "mpi/collect_all_waits_for_a_late_sender_and_fails_fast": (
        collect_all_waits_for_a_late_sender_and_fails_fast
    ),
    "mpi/onebit_gather_pattern_matches_reference": onebit_gather_pattern_matches_reference,
    "mpi/loop_stays_responsive": loop_stays_responsive,
    "mpi/lone_await_outlasting_its_spin": lone_await_outlasting_its_spin,
    "mpi/freed_requests_complete_on_await": freed_requests_complete_on_await,
    "mpi/interrupted_poll_keeps_the_status": interrupted_poll_keeps_the_status,
    "mpi/backs_off_only_when_nothing_else_is_open": backs_off_only_when_nothing_else_is_open,
    "mpi/no_thread_per_request": no_thread_per_request,
    "mpi/zero_copy_cpu_buffers": zero_copy_cpu_buffers,
    "mpi/dtype_reductions": dtype_reductions,
    "mpi/large_count_refused_without_support": large_count_refused_without_support,
    "mpi/wait_with_timeout_then_complete": wait_with_timeout_then_complete,
    "mpi/out_of_order_receive_is_seen": out_of_order_receive_is_seen,
    "mpi/interrupts_never_wedge_the_engine": interrupts_never_wedge_the_engine,
    "mpi/receive_completed_out_of_order_keeps_its_status": (
        receive_completed_out_of_order_keeps_its_status
    ),
}
