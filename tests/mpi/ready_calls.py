"""Under ``mpiexec -n 2``, with no job timeout or with one (``ready_calls.py 30``: the ready
calls' ops are then waited through an MpiOp that enforces it): a call seen before must make
exactly the call the full path would, and anything that changed since must not take it.
Prints ``READY ok`` on each rank, or the traceback."""

from __future__ import annotations

import sys
import traceback
from typing import Any

import torch

import overlap
from overlap import comm
from overlap.comm import state
from tests.gloo import contract_cases as cc
from tests.gloo.catching import catcher


def check() -> None:
    r = comm.get_rank()
    backend = state.active()
    raised: dict[str, str] = {}
    catch = catcher(raised)

    # The same tensor again and again: the first call builds, later ones hit; both exact.
    t = torch.full((4, 4), r + 1.0)
    for want in (3.0, 6.0, 12.0):
        comm.all_reduce(t)
        assert torch.equal(t, torch.full((4, 4), want)), t
    assert backend._ready, "the blocking call left no ready call"
    comm.all_reduce(t, async_op=True).wait()
    assert torch.equal(t, torch.full((4, 4), 24.0)), t

    async def awaited() -> None:
        await comm.all_reduce(t, async_op=True)

    overlap.run(awaited())
    assert torch.equal(t, torch.full((4, 4), 48.0)), t

    # Same address, bytes and dtype, but not contiguous: the documented error, nothing sent.
    view = t.t()
    assert view.data_ptr() == t.data_ptr() and view.nbytes == t.nbytes
    catch("view", lambda: comm.all_reduce(view))
    catch("view_async", lambda: comm.all_reduce(view, async_op=True))
    for name in ("view", "view_async"):
        assert raised[name].startswith("ValueError") and "contiguous" in raised[name], raised
    assert torch.equal(t, torch.full((4, 4), 48.0)), t

    # Another op on the same tensor, then back.
    x = torch.tensor([r + 1.0])
    comm.all_reduce(x, op="max")
    assert x.item() == 2.0, x
    comm.all_reduce(x)
    assert x.item() == 4.0, x
    x.fill_(r + 1.0)
    comm.all_reduce(x, op="max")
    assert x.item() == 2.0, x

    # Another dtype at the same address and size: an int sum, not a float one.
    xi = x.view(torch.int32)
    xi.fill_(r + 1)
    comm.all_reduce(xi)
    assert xi.item() == 3, xi

    # A sub-group: its own ready call; after it is destroyed, none is used for it.
    g = comm.new_group([0, 1])
    y = torch.ones(3)
    comm.all_reduce(y, group=g)
    comm.all_reduce(y, group=g)
    assert torch.equal(y, torch.full((3,), 4.0)), y
    comm.destroy_process_group(g)
    assert not any(k[4] is g for k in backend._ready), "a destroyed group kept its call"
    catch("destroyed", lambda: comm.all_reduce(y, group=g))
    assert raised["destroyed"] != "no error", raised
    assert torch.equal(y, torch.full((3,), 4.0)), y

    # One rank blocking, the other async, on the ready path and the full path (a fresh
    # tensor each time, then the same one): MPI does not match MPI_Allreduce with
    # MPI_Iallreduce, and lean-ops' blocking MPI_Allreduce hung both ranks here.
    m = torch.ones(3)
    for i in range(4):
        fresh = torch.ones(2)
        for u in (fresh, m):
            if (r + i) % 2:
                comm.all_reduce(u)
            else:
                comm.all_reduce(u, async_op=True).wait()
        assert torch.equal(fresh, torch.full((2,), 2.0)), fresh
        assert torch.equal(m, torch.full((3,), 2.0 ** (i + 1))), m

    async def mixed() -> None:
        if r == 0:
            await comm.all_reduce(m, async_op=True)
        else:
            comm.all_reduce(m)

    overlap.run(mixed())
    assert torch.equal(m, torch.full((3,), 32.0)), m

    # Ctrl-C in h.wait() (rank 1 is 2 s late): MPI_Wait returns, the interrupt reaches the
    # caller, and the handle holds the result (a receive: its sender).
    from tests.gloo import scheduler_cases as sc
    from tests.gloo.test_scheduler import check_interrupted_wait

    interrupted = sc.interrupted_wait()
    if r == 0:
        check_interrupted_wait(interrupted)

    # A tracer attached after the call was cached still sees every op.
    z = torch.ones(2)
    comm.all_reduce(z)
    with overlap.Tracer() as tr:
        comm.all_reduce(z)
        comm.all_reduce(z, async_op=True).wait()
    seen = [s for s in tr.spans if s[1] == "comm" and s[0] == "all_reduce"]
    assert len(seen) == 2, tr.spans
    assert torch.equal(z, torch.full((2,), 8.0)), z

    # The last ready call is taken by the tensor object's identity: the same object changed
    # in place since must not take it (each change first follows a call that set it).
    u = torch.full((2, 2), r + 1.0)
    comm.all_reduce(u)
    comm.all_reduce(u)  # taken from the dict, and kept as the last ready call
    assert backend._last is not None and backend._last[0]() is u, "no last ready call"
    u.t_()  # the same object, the same address and bytes, not contiguous
    catch("t_", lambda: comm.all_reduce(u))
    assert raised["t_"].startswith("ValueError") and "contiguous" in raised["t_"], raised
    u.t_()
    comm.all_reduce(u)
    assert torch.equal(u, torch.full((2, 2), 12.0)), u
    u.resize_(3)  # fewer bytes at the same address: the 3 elements only
    u.fill_(r + 1.0)
    comm.all_reduce(u)
    assert torch.equal(u, torch.full((3,), 3.0)), u
    comm.all_reduce(u)
    u.data = u.view(torch.int32)  # the same object, another dtype: an int sum
    # (values whose bits are normal floats: a float sum of small ints' bits, subnormals,
    # would give the int sum's bits too)
    u.fill_((r + 1) << 24)
    comm.all_reduce(u)
    want = torch.full((3,), 3 << 24, dtype=torch.int32)
    assert u.dtype == torch.int32 and torch.equal(u, want), u
    u.set_(torch.full((3,), r + 1, dtype=torch.int32).untyped_storage())  # another address
    comm.all_reduce(u)
    comm.all_reduce(u)
    assert torch.equal(u, torch.full((3,), 6, dtype=torch.int32)), u
    g2 = comm.new_group([0, 1])
    comm.all_reduce(u, group=g2)  # the same object on another group: its own call
    assert torch.equal(u, torch.full((3,), 12, dtype=torch.int32)), u
    comm.all_reduce(u, op="max")  # and another op
    assert torch.equal(u, torch.full((3,), 12, dtype=torch.int32)), u
    comm.destroy_process_group(g2)
    assert backend._last is None, "a destroyed group's call stayed the last ready call"
    comm.all_reduce(u)
    comm.all_reduce(u)
    from overlap.comm import debug

    debug.set_enabled(True)  # debug mode checks every call across the ranks
    try:
        comm.all_reduce(u)
        catch("debug", lambda: comm.all_reduce(u, op="max" if r else "sum"))
    finally:
        debug.set_enabled(False)
    assert "mismatch" in raised["debug"].lower() or "differ" in raised["debug"].lower(), raised


def check_p2p() -> None:
    """isend/irecv seen before take their ready calls: the same matching, values, sender
    and errors as the full path, and nothing changed since gets through."""
    r = comm.get_rank()
    peer = 1 - r
    backend = state.active()
    raised: dict[str, str] = {}
    catch = catcher(raised)
    out, inp = torch.zeros(4), torch.full((4,), float(r))
    for i in range(3):  # the first builds, later ones hit
        inp.fill_(float(10 * i + r))
        got = comm.irecv(out, src=peer)
        comm.isend(inp, dst=peer).wait()
        got.wait()
        assert torch.equal(out, torch.full((4,), float(10 * i + peer))), (i, out)
        assert got.source == peer, got.source
    assert any(k[0] == "isend" for k in backend._ready if isinstance(k[0], str)), backend._ready
    assert any(k[0] == "irecv" for k in backend._ready if isinstance(k[0], str)), backend._ready

    # Two tags in flight on the same tensors' addresses: each lands where its tag says.
    a, b = torch.zeros(2), torch.zeros(2)
    ha, hb = comm.irecv(a, src=peer, tag=1), comm.irecv(b, src=peer, tag=2)
    comm.isend(torch.full((2,), 2.0), dst=peer, tag=2).wait()
    comm.isend(torch.full((2,), 1.0), dst=peer, tag=1).wait()
    ha.wait()
    hb.wait()
    assert a.tolist() == [1.0, 1.0] and b.tolist() == [2.0, 2.0], (a, b)

    # Awaited, on the ready path.
    async def pair() -> None:
        await comm.collect_all([comm.irecv(out, src=peer), comm.isend(inp, dst=peer)])

    inp.fill_(float(100 + r))
    overlap.run(pair())
    assert torch.equal(out, torch.full((4,), float(100 + peer))), out

    # A peer given as True or 1.0 hashes like 1: the full path's answer, nothing sent.
    catch("bool_dst", lambda: comm.isend(inp, dst=True))
    catch("float_src", lambda: comm.irecv(out, src=1.0))  # type: ignore[arg-type]
    assert raised["bool_dst"] != "no error" and raised["float_src"] != "no error", raised

    # Same address, bytes and dtype, not contiguous: the documented error, nothing sent.
    sq, sq2 = torch.zeros(2, 2), torch.ones(2, 2)
    hsq = comm.irecv(sq, src=peer)
    comm.isend(sq2, dst=peer).wait()
    hsq.wait()
    catch("view_send", lambda: comm.isend(sq2.t(), dst=peer))
    catch("view_recv", lambda: comm.irecv(sq.t(), src=peer))
    for name in ("view_send", "view_recv"):
        assert raised[name].startswith("ValueError") and "contiguous" in raised[name], raised

    # A short message into a receive on the ready path: still refused with its sizes.
    big, small = torch.zeros(4), torch.ones(2)
    h1 = comm.irecv(big, src=peer, tag=5)
    comm.isend(torch.ones(4), dst=peer, tag=5).wait()
    h1.wait()
    h2 = comm.irecv(big, src=peer, tag=5)
    comm.isend(small, dst=peer, tag=5).wait()
    catch("short", lambda: h2.wait())
    assert raised["short"].startswith("MessageMismatchError") and "2 bytes" not in raised["short"]
    assert "received 8 bytes" in raised["short"], raised["short"]

    # The last ready send and receive, by the tensor object (as all_reduce's): the same
    # objects changed in place, or called with another tag, source or group, do not take it
    # (the case gloo's last calls run too).
    assert cc.p2p_last_call() == "ok"
    assert cc.p2p_last_call(blocking=True) == "ok"  # send and recv: the same kept calls


def check_sendrecv() -> None:
    """comm.sendrecv's kept exchange: the values and sender of its first call; a short
    message refused with its sizes on the kept path (blocking, waited and awaited); a pair
    whose receive has landed while its send is still in flight stays pending until the send
    is over (the MpiPair's second stage); and a destroyed job's memo is not used."""
    import asyncio
    import time

    r = comm.get_rank()
    peer = 1 - r
    backend = state.active()
    send, recv = torch.zeros(4), torch.zeros(4)
    for i in range(3):
        send.fill_(float(10 * i + r))
        assert comm.sendrecv(send, peer, recv, peer) is recv
        assert recv.tolist() == [float(10 * i + peer)] * 4, (i, recv)
    memo = backend._last_sr
    assert memo is not None and memo[0]() is send and memo[1]() is recv, memo

    # A short message into the kept receive: rank 1 sends 2 floats where rank 0's kept
    # exchange receives 4.
    four, two = torch.ones(4), torch.ones(2)
    got = torch.zeros(4)
    comm.sendrecv(four, peer, got, peer)  # kept on both ranks
    raised: list[str] = []
    for how in ("blocking", "wait", "await"):
        got.zero_()
        mine = four if r == 0 else two
        try:
            if how == "blocking":
                comm.sendrecv(mine, peer, got, peer)
            elif how == "wait":
                comm.sendrecv(mine, peer, got, peer, async_op=True).wait()
            else:

                async def aw(mine: torch.Tensor = mine) -> None:
                    await comm.sendrecv(mine, peer, got, peer, async_op=True)

                overlap.run(aw())
            raised.append("no error")
        except Exception as exc:
            raised.append(f"{type(exc).__name__}: {exc}")
    if r == 0:
        for how, msg in zip(("blocking", "wait", "await"), raised, strict=True):
            assert msg.startswith("MessageMismatchError") and "received 8 bytes" in msg, (how, msg)
            assert "16-byte tensor" in msg, msg
    else:
        assert raised == ["no error"] * 3, raised
    comm.barrier()

    # The receive lands at once (tested by h.done()); the 4 MiB send waits for rank 1's
    # receive, posted 0.4 s later (above MPICH's eager limit, a send completes only when it
    # is received).
    large, small = torch.full((1 << 20,), 7.0), torch.zeros(2)
    if r == 0:
        h = comm.sendrecv(large, peer, small, peer, async_op=True)
        end = time.monotonic() + 0.2
        while time.monotonic() < end:  # MPI moves messages only inside MPI calls
            pending = not h.done()
            time.sleep(0.005)
        landed = small.tolist()
        t0 = time.monotonic()
        assert h.wait() is small and h.source == peer
        waited = time.monotonic() - t0
        assert landed == [5.0, 5.0], landed
        assert pending and waited > 0.1, (pending, waited)
        comm.barrier()
    else:
        comm.send(torch.full((2,), 5.0), dst=peer)
        time.sleep(0.4)
        into = torch.zeros(1 << 20)
        comm.recv(into, src=peer)
        assert bool((into == 7.0).all())
        comm.barrier()

    # A receive that fails (MPI's truncation: 4 floats into 2) while the 4 MiB send is
    # still in flight: the handle fails, and its send's request and tensor are kept where
    # MPI may still read them (before, the tensor went with the handle), so rank 1 gets
    # the right bytes after rank 0 dropped it.
    from overlap.comm import progress

    if r == 0:
        buried = len(progress._graveyard)
        h = comm.sendrecv(torch.full((1 << 20,), 9.0), peer, small, peer, async_op=True)
        try:
            h.wait()
            failed = "no error"
        except Exception as exc:
            failed = f"{type(exc).__name__}: {exc}"
        assert failed.startswith("CommError") and "truncated" in failed, failed
        kept = progress._graveyard[buried:]
        assert len(kept) == 1 and kept[0][1][0].numel() == 1 << 20, kept
        del h
        comm.barrier()
    else:
        comm.send(torch.ones(4), dst=peer)
        time.sleep(0.3)
        into = torch.zeros(1 << 20)
        comm.recv(into, src=peer)
        assert bool((into == 9.0).all())
        comm.barrier()

    # The same, awaited: the loop's engine completes both stages.
    async def staged() -> tuple[bool, float]:
        h = comm.sendrecv(large, peer, small, peer, async_op=True)
        await asyncio.sleep(0.2)
        pending = not h.done()
        t0 = time.monotonic()
        await h
        return pending, time.monotonic() - t0

    if r == 0:
        small.zero_()
        pending, waited = overlap.run(staged())
        assert pending and waited > 0.1 and small.tolist() == [5.0, 5.0], (pending, waited)
    else:
        comm.send(torch.full((2,), 5.0), dst=peer)
        time.sleep(0.4)
        comm.recv(torch.zeros(1 << 20), src=peer)
    comm.barrier()


def check_broadcast() -> None:
    """broadcast seen before takes its ready call: the root's values, from the root the call
    names (not the one cached), and nothing changed since gets through."""
    r = comm.get_rank()
    backend = state.active()
    raised: dict[str, str] = {}
    catch = catcher(raised)
    t = torch.zeros(2, 2)
    for i in range(3):  # the first builds, later ones hit; blocking, waited, awaited
        t.fill_(float(10 * i + r))
        if i == 0:
            comm.broadcast(t, 0)
        elif i == 1:
            comm.broadcast(t, 0, async_op=True).wait()
        else:

            async def awaited() -> None:
                await comm.broadcast(t, 0, async_op=True)

            overlap.run(awaited())
        assert torch.equal(t, torch.full((2, 2), float(10 * i))), (i, t)
    assert any(k[0] == "broadcast" for k in backend._ready if isinstance(k[0], str))

    # Another root at the same address: that root's values.
    t.fill_(float(r + 7))
    comm.broadcast(t, 1)
    assert torch.equal(t, torch.full((2, 2), 8.0)), t
    t.fill_(float(r + 7))
    comm.broadcast(t, 0)
    assert torch.equal(t, torch.full((2, 2), 7.0)), t

    # Same address, bytes and dtype, not contiguous; a root given as True: the full path's
    # errors, nothing sent.
    catch("view", lambda: comm.broadcast(t.t(), 0))
    catch("bool_src", lambda: comm.broadcast(t, True))  # type: ignore[arg-type]
    assert raised["view"].startswith("ValueError") and "contiguous" in raised["view"], raised
    assert raised["bool_src"] != "no error", raised

    # A tracer attached after the call was cached still sees it.
    with overlap.Tracer() as tr:
        comm.broadcast(t, 0)
    assert [s for s in tr.spans if s[1] == "comm" and s[0] == "broadcast"], tr.spans

    # The last ready call, by the tensor object (all_reduce's): the same object changed in
    # place does not take it.
    comm.broadcast(t, 0)
    assert backend._last_bcast is not None and backend._last_bcast[0]() is t
    t.t_()
    catch("t_", lambda: comm.broadcast(t, 0))
    assert raised["t_"].startswith("ValueError") and "contiguous" in raised["t_"], raised
    t.t_()
    t.fill_(float(r + 1))
    comm.broadcast(t, 1)  # another root, the same object: root 1's values
    assert torch.equal(t, torch.full((2, 2), 2.0)), t
    comm.broadcast(t, 1)
    t.data = t.view(torch.int32)  # another dtype, same object, address and bytes
    t.fill_((r + 1) << 24)
    comm.broadcast(t, 1)
    assert t.dtype == torch.int32 and torch.equal(t, torch.full((2, 2), 2 << 24, dtype=torch.int32))
    t.resize_(3)
    t.fill_(r + 5)
    comm.broadcast(t, 0)
    assert torch.equal(t, torch.full((3,), 5, dtype=torch.int32)), t


def check_done_at_post() -> None:
    """A ready op that MPI finishes by the test right after its post is returned done (on a
    one-rank group every op is), with the right result through wait, await and
    collect_all, and nothing left open."""
    from overlap.comm import progress

    r = comm.get_rank()
    groups = [comm.new_group([0]), comm.new_group([1])]  # every rank makes both, in order
    mine = groups[r]
    x = torch.full((3,), r + 1.0)
    comm.all_reduce(x, group=mine)  # the first call builds the ready call
    comm.broadcast(x, r, group=mine)
    for i in range(3):
        before = progress._open
        hs = [
            comm.all_reduce(x, group=mine, async_op=True),
            comm.broadcast(x, r, group=mine, async_op=True),
        ]
        assert progress._open == before, "an op the post's test finished was left open"
        assert all(h.done() for h in hs)
        if i == 0:
            assert all(h.wait() is x for h in hs)
        elif i == 1:

            async def each(hs: list[Any] = hs) -> list[object]:
                return [await h for h in hs]

            assert all(y is x for y in overlap.run(each()))
        else:

            async def together(hs: list[Any] = hs) -> object:
                return await comm.collect_all(hs)

            overlap.run(together())
    assert torch.equal(x, torch.full((3,), r + 1.0)), x
    for g in groups:
        comm.destroy_process_group(g)


def check_tensor_collectives() -> None:
    """all_gather_into_tensor, reduce_scatter (a flat input) and all_to_all_single (no
    splits) seen before take their ready calls: the same results as the full path,
    blocking, waited and awaited, and nothing changed since gets through (a reshaped view
    at the same address, a non-contiguous one, another dtype or reduce op, an input inside
    the output, a list input, split sizes)."""
    r = comm.get_rank()
    backend = state.active()
    raised: dict[str, str] = {}
    catch = catcher(raised)
    inp, out = torch.zeros(2), torch.zeros(4)

    def finish(h: Any, how: int) -> None:
        if how == 1:
            h.wait()
        elif how == 2:

            async def awaited(h: Any = h) -> None:
                await h

            overlap.run(awaited())

    for i in range(4):  # the first builds, later ones hit; blocking, waited, awaited
        inp.copy_(torch.tensor([10.0 * i + r, 10.0 * i + r + 0.5]))
        how = i % 3
        finish(comm.all_gather_into_tensor(out, inp, async_op=how > 0), how)
        want = [10.0 * i, 10.0 * i + 0.5, 10.0 * i + 1, 10.0 * i + 1.5]
        assert out.tolist() == want, (i, out)
        big = torch.arange(4.0) + 10 * i + r
        finish(comm.reduce_scatter(inp, big, async_op=how > 0), how)
        assert inp.tolist() == [2 * (2 * r + x + 10 * i) + 1 for x in (0.0, 1.0)], (i, inp)
        src = torch.arange(4.0) + 100 * r + i
        finish(comm.all_to_all_single(out, src, async_op=how > 0), how)
        want = [100.0 * 0 + 2 * r + i, 100.0 * 0 + 2 * r + 1 + i]
        want += [100.0 * 1 + 2 * r + i, 100.0 * 1 + 2 * r + 1 + i]
        assert out.tolist() == want, (i, out)
    kinds = {k[0] for k in backend._ready if isinstance(k[0], str)}
    assert {"all_gather_into_tensor", "reduce_scatter", "all_to_all_single"} <= kinds, kinds

    # Another reduce op on the same tensors: its own call.
    big = torch.arange(4.0) + r
    comm.reduce_scatter(inp, big, op="max")
    comm.reduce_scatter(inp, big, op="max")
    assert inp.tolist() == [2.0 * r + 1, 2.0 * r + 2], inp

    # A view with the same address and bytes but rows that do not split across 2 ranks,
    # or a 0-dim one, or a non-contiguous one: the full path's errors, nothing sent.
    rows = torch.zeros(2, 3)
    dst = torch.zeros(2, 3)
    comm.all_to_all_single(dst, rows)
    comm.all_to_all_single(dst, rows)
    catch("rows", lambda: comm.all_to_all_single(dst.view(3, 2), rows.view(3, 2)))
    assert raised["rows"] != "no error", raised
    one, two = torch.zeros(1), torch.zeros(2)
    comm.all_gather_into_tensor(two, one)
    comm.all_gather_into_tensor(two, one)
    catch("zero_dim", lambda: comm.all_gather_into_tensor(two, one.reshape(())))
    assert raised["zero_dim"].startswith("ValueError") and "0-dim" in raised["zero_dim"], raised
    sq, sq2 = torch.zeros(2, 2), torch.zeros(4, 2)
    comm.all_gather_into_tensor(sq2, sq)
    catch("view", lambda: comm.all_gather_into_tensor(sq2, sq.t()))
    assert raised["view"].startswith("ValueError") and "contiguous" in raised["view"], raised

    # Another dtype at the same addresses: an int gather, an int sum.
    ii, io = inp.view(torch.int32), out.view(torch.int32)
    io.copy_(torch.arange(4, dtype=torch.int32) + r)
    comm.reduce_scatter(ii, io)
    assert ii.tolist() == [2 * (2 * r + x) + 1 for x in (0, 1)], ii
    io.copy_(torch.arange(4, dtype=torch.int32) + r)
    comm.all_gather_into_tensor(io, ii)
    assert io.tolist() == [2 * x + 1 for x in (0, 1)] + [2 * (2 + x) + 1 for x in (0, 1)], io

    # ZeRO's pattern: the input is this rank's slot of the output. The full path copies
    # the input first, every time; nothing is kept for it, and every call is right.
    flat = torch.zeros(4)
    mine = flat.narrow(0, 2 * r, 2)
    for i in range(3):
        mine.fill_(float(i + r))
        comm.all_gather_into_tensor(flat, mine)
        assert flat.tolist() == [float(i)] * 2 + [float(i + 1)] * 2, (i, flat)
    assert not any(
        k[0] == "all_gather_into_tensor" and k[1] == flat.data_ptr()
        for k in backend._ready
        if isinstance(k[0], str)
    ), "an aliased gather was kept"

    # The op's last ready call is taken by the tensor objects' identity (_ready_two): the
    # same objects changed in place since must not take it.
    src6, dst6 = torch.arange(6.0) + 10 * r, torch.zeros(6)
    src6.resize_(2, 3)
    dst6.resize_(2, 3)
    for _ in range(3):
        comm.all_to_all_single(dst6, src6)
    assert backend._last_two["all_to_all_single"][0]() is dst6, "no last ready call"
    assert dst6.flatten().tolist() == [0.0, 1, 2, 10, 11, 12] if r == 0 else [3.0, 4, 5, 13, 14, 15]
    src6.resize_(3, 2)  # the same objects, address and bytes; rows that do not split
    dst6.resize_(3, 2)
    catch("same_rows", lambda: comm.all_to_all_single(dst6, src6))
    assert raised["same_rows"] != "no error", raised
    src6.resize_(2, 3)
    dst6.resize_(2, 3)
    src6.t_()  # the same object, not contiguous
    catch("same_t_", lambda: comm.all_to_all_single(dst6, src6))
    assert "contiguous" in raised["same_t_"], raised
    src6.t_()
    comm.all_to_all_single(dst6, src6)
    src6.data = src6.view(torch.int32)  # the same objects, another dtype: int values
    dst6.data = dst6.view(torch.int32)
    src6.fill_(r + 1)
    comm.all_to_all_single(dst6, src6)
    assert dst6.dtype == torch.int32 and dst6.flatten().tolist() == [1] * 3 + [2] * 3, dst6
    g4 = comm.new_group([0, 1])
    comm.all_to_all_single(dst6, src6, group=g4)  # another group object: its own call
    comm.all_to_all_single(dst6, src6, group=g4)
    comm.destroy_process_group(g4)
    assert not backend._last_two, "a destroyed group's call stayed a last ready call"
    b2, s2 = torch.arange(4.0) + r, torch.zeros(2)
    sums = [2 * (2 * r + x) + 1 for x in (0.0, 1.0)]
    maxes = [2.0 * r + 1, 2.0 * r + 2]
    for op, want in (("sum", sums), ("max", maxes), ("sum", sums)):
        comm.reduce_scatter(s2, b2, op=op)  # the same objects, another reduce op
        comm.reduce_scatter(s2, b2, op=op)
        assert s2.tolist() == want, (op, s2)

    # A list input and split sizes take the full path, as they always did.
    o2 = torch.zeros(2)
    comm.reduce_scatter(o2, [torch.full((2,), 1.0), torch.full((2,), 2.0)])
    assert o2.tolist() == [2.0 * (r + 1)] * 2, o2
    s4 = torch.arange(4.0) + 10 * r
    d4 = torch.zeros(4)
    comm.all_to_all_single(d4, s4, [2, 2], [2, 2])
    assert d4.tolist() == [2.0 * r, 2.0 * r + 1, 10 + 2.0 * r, 11 + 2.0 * r], d4


def main() -> None:
    timeout = float(sys.argv[1]) if len(sys.argv) > 1 else None
    overlap.init_distributed(dist_backend="mpi", timeout=timeout)
    assert state.active().timeout == timeout
    try:
        check()
        check_p2p()
        check_sendrecv()
        check_broadcast()
        check_done_at_post()
        check_tensor_collectives()
        out = "READY ok"
    except BaseException:
        out = "READY " + traceback.format_exc().replace("\n", " | ")
    sys.stdout.write(f"{out}\n")
    sys.stdout.flush()
    comm.destroy_process_group()


if __name__ == "__main__":
    main()
