"""Rank-side fault injection and load checks (docs/reliability.md has the figures)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from typing import Any

import torch
from torch import nn

import overlap
from overlap import BucketScheduler, CommError, comm
from overlap.comm import ReduceOp, debug
from overlap.comm.waiters import get_pool
from overlap.compression import OneBit, compressed_allreduce, padded_numel
from overlap.errors import CollectiveMismatchError


def mismatch_is_detected() -> dict[str, Any]:
    r = comm.get_rank()
    debug.set_enabled(True)
    out: dict[str, Any] = {}
    try:
        for name, fn in (
            ("shape", lambda: comm.all_reduce(torch.ones(4 if r == 0 else 8))),
            (
                "op",
                lambda: (
                    comm.all_reduce(torch.ones(4))
                    if r == 0
                    else comm.broadcast(torch.ones(4), src=0)
                ),
            ),
            (
                "dtype",
                lambda: comm.all_reduce(torch.ones(4, dtype=torch.float64 if r else torch.float32)),
            ),
            ("reduce_op", lambda: comm.all_reduce(torch.ones(4), op="sum" if r == 0 else "max")),
            # no check before the forty-sixth session: gloo's thread ended both processes
            (
                "reduce_scatter_tensor",
                lambda: comm.reduce_scatter_tensor(
                    torch.empty(2, dtype=torch.float64 if r else torch.float32),
                    torch.ones(4, dtype=torch.float64 if r else torch.float32),
                ),
            ),
            ("root", lambda: comm.broadcast(torch.ones(4), src=r)),
            # rank 1 expects a row less from rank 0 than it sends, and one more from itself
            ("splits", lambda: _all_to_all(wrong=True)),
            # rank 1 expects one float64 from rank 0, which sends two float32s: the same
            # bytes, so only the check tells
            ("list_dtype", lambda: _list_all_to_all(wrong=True)),
        ):
            try:
                fn()
                out[name] = "no error"
            except CollectiveMismatchError as e:
                out[name] = (e.ranks, str(e))
        t = torch.ones(3)
        comm.all_reduce(t, op=ReduceOp.SUM if r == 0 else "sum")  # both spellings agree
        out["after"] = t.tolist()
        out["uneven"] = _all_to_all(wrong=False)  # each rank its own sizes: 0.1.0 flagged it
        # float64 to rank 0, float32 to the others: flagged until the fortieth session
        out["uneven_list"] = _list_all_to_all(wrong=False)
        out["scheduler"] = _correct_scheduler_loop()  # never flagged
        out["scheduler_unused"] = _uncompressed_loop_with_a_layer_one_rank_skips()  # no hang
    finally:
        debug.set_enabled(False)
    return out


def in_flight_writes_are_named() -> dict[str, Any]:
    """Debug mode, 2 ranks: rank 0 (rank 1 for a receive) writes an async op's tensor in
    place while the op is in flight (the peer issues its side 0.2 s later). Per case, this
    rank's ``("ok", values)`` or ``(error class, message)``; then correct uses of the same
    ops and a sum that shows the group still in step."""
    r = comm.get_rank()
    debug.set_enabled(True)

    def late() -> None:
        if r == 1:
            time.sleep(0.2)

    def outcome(fn: Any) -> Any:
        try:
            return ("ok", fn())
        except Exception as e:
            return (type(e).__name__, str(e))

    def all_reduce(write: Any) -> list[float]:
        t = torch.ones(4)
        late()
        h = comm.all_reduce(t, async_op=True)
        if r == 0:
            write(t)
        h.wait()
        return t.tolist()

    def awaited_broadcast() -> list[float]:
        t = torch.full((2,), float(r))
        late()

        async def go() -> None:
            h = comm.broadcast(t, 0, async_op=True)
            if r == 0:
                t.add_(1)
            await h

        overlap.run(go())
        return t.tolist()

    def isend() -> Any:
        s, into = torch.full((3,), float(r)), torch.zeros(3)
        late()
        if r == 0:
            h = comm.isend(s, 1)
            s.add_(100)
            h.wait()
            return "sent"
        comm.recv(into, 0)
        return into.tolist()

    def irecv() -> Any:
        into = torch.zeros(3)
        if r == 0:
            time.sleep(0.2)
            comm.send(torch.ones(3), 1)
            return "sent"
        h = comm.irecv(into, 0)
        into.add_(7)
        h.wait()
        return into.tolist()

    def never_flagged() -> list[Any]:
        """What looks alike and is not a race: overlap's own post-processing (an average,
        a bf16 max staged in float32, a float max's ordered keys), a write after the wait,
        a write to another part of the same base, a multi-phase op's own phases."""
        out: list[Any] = []
        late()
        a = torch.full((3,), float(r + 1))
        b = torch.full((3,), float(r + 1), dtype=torch.bfloat16)
        c = torch.full((3,), float(r + 1))
        hs = [
            comm.all_reduce(a, op="avg", async_op=True),
            comm.all_reduce(b, op="max", async_op=True),
            comm.all_reduce(c, op="max", async_op=True),
        ]
        for h in hs:
            h.wait()
        a.add_(1)
        flat = torch.ones(8)
        h = comm.all_reduce(flat[:4], async_op=True)
        flat[4:].mul_(3)
        h.wait()
        ts = [torch.full((2,), float(r)), torch.full((3,), float(r), dtype=torch.float64)]
        outs = [torch.zeros(2 * t.numel(), dtype=t.dtype) for t in ts]
        comm.all_gather_coalesced(outs, ts, async_op=True).wait()
        out += [a.tolist(), b.float().tolist(), c.tolist(), flat.tolist()]
        out.append([x for o in outs for x in o.tolist()])
        return out

    out: dict[str, Any] = {}
    try:
        out["all_reduce"] = outcome(lambda: all_reduce(lambda t: t.mul_(5)))
        out["all_reduce_view"] = outcome(lambda: all_reduce(lambda t: t[1:3].zero_()))
        out["broadcast_awaited"] = outcome(awaited_broadcast)
        out["isend"] = outcome(isend)
        out["irecv"] = outcome(irecv)
        out["never_flagged"] = outcome(never_flagged)
        t = torch.full((2,), float(r + 1))
        comm.all_reduce(t)
        out["after"] = t.tolist()
    finally:
        debug.set_enabled(False)
    return out


def check_in_flight_writes(res: list[dict[str, Any]]) -> None:
    """Asserts on both ranks' :func:`in_flight_writes_are_named` (gloo and MPI alike)."""
    named = "was written in place while the op was in flight"
    for case, op, writer in (
        ("all_reduce", "all_reduce", 0),
        ("all_reduce_view", "all_reduce", 0),
        ("broadcast_awaited", "broadcast", 0),
        ("isend", "isend", 0),
        ("irecv", "irecv", 1),
    ):
        kind, msg = res[writer][case]
        assert kind == "InFlightWriteError", (case, res[writer][case])
        assert msg.startswith(f"{op} on rank {writer}: its tensor") and named in msg, msg
        assert "Wait for the handle (h.wait() or await h) before writing" in msg, msg
        assert res[1 - writer][case][0] == "ok", (case, res[1 - writer][case])
    for r, out in enumerate(res):
        assert out["never_flagged"] == (
            "ok",
            [
                [2.5] * 3,
                [2.0] * 3,
                [2.0] * 3,
                [2.0] * 4 + [3.0] * 4,
                [0.0, 0.0, 1.0, 1.0] + [0.0] * 3 + [1.0] * 3,
            ],
        ), (r, out["never_flagged"])
        assert out["after"] == [3.0, 3.0], out


def message_mismatch_is_detected(in_debug_mode: bool = True) -> dict[str, Any]:
    """Rank 0 sends rank 1 (tag 5) messages that do not fit the receive, in debug mode
    unless told otherwise, then messages that do. Rank 1's outcome per case: ``("ok",
    sender, values)`` or ``(error class, error ranks, message, the receiving tensor
    after)``."""
    r = comm.get_rank()
    debug.set_enabled(in_debug_mode)
    out: dict[str, Any] = {}
    f32, i32 = torch.float32, torch.int32
    cases = [  # name, sent shape, receiving shape and dtype, receive from any rank
        ("bigger", (3,), (5,), f32, False),
        ("smaller", (8,), (4,), f32, False),
        ("dtype", (4,), (4,), i32, False),
        ("reshaped", (2, 2), (4,), f32, False),  # shapes may differ, as in torch
        ("after", (4,), (4,), f32, True),  # every bad message was consumed: in step
    ]
    try:
        for name, sent, shape, dtype, anyone in cases:
            if r == 0:
                comm.send(torch.arange(1.0, 1.0 + torch.Size(sent).numel()).view(sent), 1, tag=5)
            elif r == 1:
                buf = torch.full(shape, -1, dtype=dtype)
                try:
                    who = comm.recv(buf, src=None if anyone else 0, tag=5)
                    out[name] = ("ok", who, buf.tolist())
                except CommError as e:
                    out[name] = (type(e).__name__, getattr(e, "ranks", None), str(e), buf.tolist())
            comm.barrier()
        # two receives in flight from one peer on one tag, awaited out of order
        if r == 0:
            for h in [comm.isend(torch.full((n,), float(n)), 1, tag=6) for n in (2, 3)]:
                h.wait()
        elif r == 1:
            bufs = [torch.zeros(2), torch.zeros(3)]
            hs = [comm.irecv(b, 0, tag=6) for b in bufs]

            async def both() -> list[Any]:
                return [t.tolist() for t in reversed(await asyncio.gather(*reversed(hs)))]

            out["in_flight"] = asyncio.run(both())
        comm.barrier()
    finally:
        debug.set_enabled(False)
    return out


def _all_to_all(wrong: bool) -> bool:
    """An uneven all_to_all_single of rows of 2: rank i sends i + j + 1 rows to rank j. With
    ``wrong``, rank 1 expects one row less from rank 0 and one more from itself (the same
    total). Returns whether every received row is the one sent."""
    r, w = comm.get_rank(), comm.get_world_size()
    sends = [[i + j + 1 for j in range(w)] for i in range(w)]
    expects = [sends[i][r] for i in range(w)]
    if wrong and r == 1:
        expects[0] -= 1
        expects[1] += 1
    x = (torch.arange(2 * sum(sends[r]), dtype=torch.float32) + 1000 * r).view(-1, 2)
    o = torch.zeros(sum(expects), 2)
    comm.all_to_all_single(o, x, expects, sends[r])
    want = [2 * (sum(sends[i][:r]) + k) + 1000 * i for i in range(w) for k in range(sends[i][r])]
    return bool(o[:, 0].tolist() == want)


def _list_all_to_all(wrong: bool) -> bool:
    """An all_to_all of lists: rank i sends rank j i + j + 1 elements, in float64 to rank 0
    and float32 to the others, so rank 0's outputs are float64 and every other rank's are
    not. With ``wrong``, rank 1 expects one float64 from rank 0 where it sends two float32s
    (the same bytes). Returns whether every output holds what was sent."""
    r, w = comm.get_rank(), comm.get_world_size()

    def dt(j: int) -> torch.dtype:
        return torch.float64 if j == 0 else torch.float32

    ins = [torch.full((r + j + 1,), float(10 * r + j), dtype=dt(j)) for j in range(w)]
    outs = [torch.zeros(q + r + 1, dtype=dt(r)) for q in range(w)]
    if wrong and r == 1:
        outs[0] = torch.zeros(1, dtype=torch.float64)  # rank 0 sends 2 float32s
    comm.all_to_all(outs, ins)
    return all(o.tolist() == [float(10 * q + r)] * (q + r + 1) for q, o in enumerate(outs))


def _correct_scheduler_loop() -> str:
    """A correct BucketScheduler loop in debug mode (its worker checks its buckets while
    the main thread checks the used-parameter mask): no false mismatch."""
    from overlap import BucketScheduler, OneBit

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    sched = BucketScheduler(model, compression=OneBit(), bucket_cap_mb=0.002, first_bucket_mb=0.001)
    try:
        for i in range(4):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i))
            model(x).sum().backward()
            sched.synchronize()
            comm.all_reduce(torch.ones(2))  # the caller's own ops on the world group
    finally:
        sched.remove()
    return "ok"


def _uncompressed_loop_with_a_layer_one_rank_skips() -> str:
    """An uncompressed scheduler in debug mode where rank 0 alone uses the last layer: its
    bucket is ready on rank 0 during backward and on the others only after the step's vote.
    Launched from the gradient hook, its debug check held rank 0's training thread while the
    others waited in the vote's check on the other group: every rank hung."""
    from overlap import BucketScheduler

    r = comm.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    sched = BucketScheduler(model, bucket_cap_mb=0.0005, first_bucket_mb=0.0005)
    try:
        for i in range(3):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i))
            y = model[0](x)
            (model[1](y) if r == 0 else y).sum().backward()
            sched.synchronize()
        grad = model[1].weight.grad
        assert grad is not None  # every rank gets the average: rank 0's share, zeros elsewhere
        want = torch.empty_like(grad)
        if r == 0:
            want.copy_(grad)
        comm.broadcast(want, src=0)
        assert torch.equal(grad, want), "the ranks disagree"
    finally:
        sched.remove()
    return "ok"


def many_ops(n: int) -> int:
    from tests.gloo.contract_cases import many_in_flight

    return many_in_flight(n, "uvloop")


def _pooled() -> int:
    """Live threads of overlap's pools, which shrink on their own when idle, by design: the
    driver threads (overlap.comm.driver; an earlier case's async multi-phase ops leave one
    per twin group, which exits after driver.IDLE_S idle) and the waiter threads
    (overlap.comm.waiters; an earlier case's many p2p ops leave threads beyond the pool's
    keep_threads, which exit after its idle_s). One may end during this case and must not
    count as a change in the scheduler's threads; a waiter left blocked on an op shows in
    the pool's ``outstanding`` instead."""
    return sum(
        t.name.startswith(("overlap-steps-", "overlap-waiter-")) for t in threading.enumerate()
    )


def long_training_is_flat(steps: int) -> dict[str, float]:
    import psutil

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    sched = BucketScheduler(model, compression=OneBit(warmup_steps=5))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    proc = psutil.Process()
    gen = torch.Generator().manual_seed(comm.get_rank())
    warm, rss0, threads0 = steps // 10, 0, 0
    for i in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 64, generator=gen)).pow(2).mean().backward()
        sched.synchronize()
        opt.step()
        if i == warm:
            rss0, threads0 = proc.memory_info().rss, proc.num_threads() - _pooled()
    rss1, threads1 = proc.memory_info().rss, proc.num_threads() - _pooled()
    sched.remove()
    return {
        "rss_growth": (rss1 - rss0) / rss0,
        "threads_before": threads0,
        "threads_after": threads1,
        "waiters_outstanding": get_pool().outstanding,
    }


def _die_soon(delay: float) -> None:
    threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()


def peer_killed(where: str) -> Any:
    """Rank 1 is SIGKILLed mid-operation; rank 0 must see CommError, not a hang."""
    r = comm.get_rank()
    if where == "collective":
        if r == 1:
            _die_soon(0.3)
            time.sleep(30)
        t0 = time.monotonic()
        try:

            async def main() -> None:
                await comm.all_reduce(torch.ones(1 << 16), async_op=True)

            overlap.run(main())
        except CommError as e:
            return ["CommError", time.monotonic() - t0, type(e.__cause__).__name__]
        return ["no error"]
    if where == "compressed":
        n = 1 << 16
        we, se = torch.zeros(padded_numel(n, 2)), torch.zeros(padded_numel(n, 2) // 2)
        if r == 1:
            _die_soon(0.3)
            time.sleep(30)
        t0 = time.monotonic()
        try:
            compressed_allreduce(torch.ones(n), we, se)
        except CommError as e:
            return ["CommError", time.monotonic() - t0, type(e.__cause__).__name__]
        return ["no error"]
    # a bucket reduction: rank 1 dies inside backward of its third step
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(6)])
    sched = BucketScheduler(model, bucket_cap_mb=0.07, first_bucket_mb=0.07)
    if r == 1:
        calls = [0]

        def hook(_: torch.Tensor) -> None:
            calls[0] += 1
            if calls[0] == 3 * 2 + 2:  # a few gradients into step 3: buckets in flight
                os.kill(os.getpid(), signal.SIGKILL)

        model[2].weight.register_post_accumulate_grad_hook(hook)
        model[3].weight.register_post_accumulate_grad_hook(hook)
    t0 = time.monotonic()
    try:
        for _ in range(10):
            t0 = time.monotonic()
            model(torch.randn(32, 128)).sum().backward()
            sched.synchronize()
    except CommError as e:
        return ["CommError", time.monotonic() - t0, type(e.__cause__).__name__]
    return ["no error"]
