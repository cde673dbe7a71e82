"""``overlap bench ops``: what it costs to finish an op by blocking, ``h.wait()`` or ``await h``.

Each rank runs one coroutine on uvloop; for every op and size it interleaves, iteration by
iteration, four ways to finish the same op, each after a barrier that lines the ranks up
(:func:`_line_up`), in an order that rotates by one every iteration (so that none always
follows the same one):

* ``torch`` (gloo) or ``MPI``: the raw backend with no overlap code in the path:
  ``torch.distributed``'s blocking call, or mpi4py's nonblocking call + ``MPI_Wait``;
* ``blocking``: overlap's blocking call;
* ``wait``: ``h = op(async_op=True); h.wait()``;
* ``await``: ``h = op(async_op=True); await h`` inside the running loop.

Rank 0's per-iteration medians are reported, with the ratios await/blocking, await/torch
and blocking/torch measured side by side in the same run, and beside await/torch and
blocking/torch their 90% bootstrap intervals (:func:`overlap.bench.harness.ratio_interval`,
paired by iteration), taken after every op is timed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from overlap import comm
from overlap.bench.harness import (
    Progress,
    Table,
    human_bytes,
    interval_cell,
    median,
    ratio_interval,
)
from overlap.bench.stopping import interrupt_once

__all__ = ["OPS", "bench_ops_rank", "ops_table"]

_AG = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_RS = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

Issue = Callable[[bool], Any]
Builder = Callable[[int, int, int], tuple[Issue, Callable[[], Any]]]


def _mpi() -> Any:
    from mpi4py import MPI

    return MPI


def _raw(t: torch.Tensor) -> Any:
    return t.reshape(-1).view(torch.uint8).numpy()


def _on_mpi() -> bool:
    return comm.get_backend() == "mpi"


def _all_reduce(n: int, r: int, w: int) -> tuple[Issue, Callable[[], Any]]:
    t = torch.ones(n)

    def ours(a: bool) -> Any:
        return comm.all_reduce(t, async_op=a)

    if _on_mpi():
        MPI = _mpi()
        buf = [_raw(t), n, MPI.FLOAT]
        return ours, lambda: MPI.COMM_WORLD.Iallreduce(MPI.IN_PLACE, buf, MPI.SUM).Wait()
    return ours, lambda: dist.all_reduce(t)


def _broadcast(n: int, r: int, w: int) -> tuple[Issue, Callable[[], Any]]:
    t = torch.ones(n)

    def ours(a: bool) -> Any:
        return comm.broadcast(t, 0, async_op=a)

    if _on_mpi():
        MPI = _mpi()
        buf = [_raw(t), MPI.BYTE]  # made once, as a user's mpi4py loop would
        return ours, lambda: MPI.COMM_WORLD.Ibcast(buf, 0).Wait()
    return ours, lambda: dist.broadcast(t, 0)


def _all_gather(n: int, r: int, w: int) -> tuple[Issue, Callable[[], Any]]:
    inp, out = torch.ones(n), torch.empty(n * w)

    def ours(a: bool) -> Any:
        return comm.all_gather_into_tensor(out, inp, async_op=a)

    if _on_mpi():
        MPI = _mpi()
        send, recv = [_raw(inp), MPI.BYTE], [_raw(out), MPI.BYTE]
        return ours, lambda: MPI.COMM_WORLD.Iallgather(send, recv).Wait()
    return ours, lambda: _AG(out, inp)


def _reduce_scatter(n: int, r: int, w: int) -> tuple[Issue, Callable[[], Any]]:
    n = max(n, w) // w * w
    inp, out = torch.ones(n), torch.empty(n // w)

    def ours(a: bool) -> Any:
        return comm.reduce_scatter(out, inp, async_op=a)

    if _on_mpi():
        MPI = _mpi()
        send, recv = [_raw(inp), n // w, MPI.FLOAT], [_raw(out), n // w, MPI.FLOAT]
        return ours, lambda: MPI.COMM_WORLD.Ireduce_scatter_block(send, recv, MPI.SUM).Wait()
    return ours, lambda: _RS(out, inp)


def _all_to_all(n: int, r: int, w: int) -> tuple[Issue, Callable[[], Any]]:
    n = max(n, w) // w * w
    inp, out = torch.ones(n), torch.empty(n)

    def ours(a: bool) -> Any:
        return comm.all_to_all_single(out, inp, async_op=a)

    if _on_mpi():
        MPI = _mpi()
        send, recv = [_raw(inp), MPI.BYTE], [_raw(out), MPI.BYTE]
        return ours, lambda: MPI.COMM_WORLD.Ialltoall(send, recv).Wait()
    return ours, lambda: dist.all_to_all_single(out, inp)


def _exchange(n: int, r: int, w: int, handles: bool = False) -> tuple[Issue, Callable[[], Any]]:
    """A ring exchange: ``comm.sendrecv``, one call and one Handle (the ``sendrecv`` row
    from the fifty-first session on), or with ``handles`` ``irecv`` + ``isend``, two Handles
    awaited with one ``collect_all`` (``isend-irecv``, the ``sendrecv`` row before). The
    reference is the backend's own pair: mpi4py's ``Irecv`` + ``Isend`` + ``Waitall``, or
    torch's ``irecv`` + ``isend`` + a wait on each."""
    send, recv = torch.ones(n), torch.empty(n)
    nxt, prv = (r + 1) % w, (r - 1) % w

    def ours(a: bool) -> Any:
        if not handles:
            return comm.sendrecv(send, nxt, recv, prv, async_op=a)
        hs = [comm.irecv(recv, src=prv), comm.isend(send, dst=nxt)]
        return hs if a else [h.wait() for h in hs]

    if _on_mpi():
        MPI = _mpi()
        c = MPI.COMM_WORLD
        # The buffers are made once, as a user's mpi4py loop would: made in the timed call
        # (a tensor view and its NumPy array, twice) they cost the reference 20-80 us a
        # pair on the 2-core machine, which flattered overlap's ratio (twenty-eighth session)
        rbuf, sbuf = [_raw(recv), MPI.BYTE], [_raw(send), MPI.BYTE]

        def theirs_mpi() -> None:
            MPI.Request.Waitall([c.Irecv(rbuf, prv), c.Isend(sbuf, nxt)])

        return ours, theirs_mpi

    def theirs() -> None:
        ws: list[Any] = [dist.irecv(recv, src=prv), dist.isend(send, dst=nxt)]
        for x in ws:
            x.wait()

    return ours, theirs


OPS: dict[str, Builder] = {
    "all_reduce": _all_reduce,
    "broadcast": _broadcast,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "all_to_all": _all_to_all,
    "sendrecv": _exchange,
    "isend-irecv": partial(_exchange, handles=True),
}


def _line_up() -> Callable[[], Any]:
    """The barrier that lines the ranks up before each timed op: of the two at hand
    (overlap's ``comm.barrier`` and the backend's own), the one after which the raw
    backend's op reads fastest, so that the ratios are not flattered by a slow reference.

    The exit of a barrier leaves the ranks skewed, and the op after it pays for the skew.
    Measured (fifty-second session, 2 ranks, two rounds each): on gloo, after overlap's
    barrier (which polls before it sleeps, waiters.poll_first) torch's 4-byte all_reduce
    read 219-221 us and after torch's ``dist.barrier`` 181-184 us, with overlap's own ops
    the same either way; so gloo lines up with torch's barrier, which also keeps overlap's
    blocking path, the thing measured, out of the line-up. On MPI the other way round:
    mpi4py's 8-byte ``Iallreduce`` + ``Wait`` read 3.05-3.06 us after overlap's barrier and
    4.22-4.27 us after mpi4py's ``Barrier``; so MPI lines up with overlap's, as before."""
    if _on_mpi():
        return comm.barrier
    return dist.barrier


def _rotated(methods: list[str], i: int) -> list[str]:
    """``methods`` in iteration ``i``'s order: every k consecutive iterations are the k
    rotations of one order (each method in each place once), and every k! iterations hold
    each of the k! orders once, so each method follows each other one (and the line-up
    before it) equally often.

    Why not rotations alone (the fifty-third session's order): a rotation keeps the cyclic
    order, so inside an iteration each method always followed the same one (blocking after
    the reference, the reference after the await), and whatever one method leaves behind
    (a waiter thread going back to sleep, a cache it warmed) always fell on the same
    neighbour."""
    k = len(methods)
    if k < 3:
        return methods[i % k :] + methods[: i % k]  # two: alternating is every order
    j = i % math.factorial(k)
    base = [methods[0], *_nth_order(methods[1:], j // k)]
    r = j % k
    return base[r:] + base[:r]


def _nth_order(items: list[str], n: int) -> list[str]:
    """The ``n``-th of the orders of ``items`` (0 <= n < len(items)!), by the factorial
    number system: each order once as n runs."""
    rest, out = list(items), []
    for left in range(len(items), 0, -1):
        q, n = divmod(n, math.factorial(left - 1))
        out.append(rest.pop(q))
    return out


def _iters_for(nbytes: int, base: int) -> int:
    if nbytes >= 16 << 20:  # a 16 MiB gloo op takes 4-12 ms here: 100 at --iters 1000
        return max(base // 10, 5)
    if nbytes >= 1 << 20:
        return max(base // 4, 10)
    return base


@interrupt_once  # a rank stopped by Ctrl-C says nothing more
def bench_ops_rank(
    ops: list[str], sizes: list[int], iters: int, warmup: int, loop: str = "uvloop"
) -> list[dict[str, Any]]:
    """Runs on every rank (inside an initialised job); returns rank-local rows."""
    import overlap

    r, w = comm.get_rank(), comm.get_world_size()
    line_up = _line_up()

    async def main() -> list[dict[str, Any]]:
        rows = []
        kept: list[dict[str, list[float]]] = []  # each row's timings, for its intervals
        bar = Progress(len(ops) * len(sizes), enabled=r == 0)
        for name in ops:
            for nbytes in sizes:
                bar.advance(f"{name} {human_bytes(nbytes)}")
                n = max(nbytes // 4, 1)
                issue, torch_call = OPS[name](n, r, w)
                # "again": the reference called a second time, under a name of its own;
                # "again"/"torch" is the run's A/A ratio, what two identical calls read
                times: dict[str, list[float]] = {
                    k: [] for k in ("torch", "blocking", "wait", "await", "again")
                }
                count = _iters_for(nbytes, iters)
                for i in range(warmup + count):
                    for method in _rotated(list(times), i):
                        line_up()
                        t0 = time.perf_counter()
                        if method == "torch" or method == "again":
                            torch_call()
                        elif method == "blocking":
                            issue(False)
                        elif method == "wait":
                            h = issue(True)
                            _ = [x.wait() for x in h] if isinstance(h, list) else h.wait()
                        else:
                            h = issue(True)
                            if isinstance(h, list):
                                await comm.collect_all(h)
                            else:
                                await h
                        dt = time.perf_counter() - t0
                        if i >= warmup:
                            times[method].append(dt)
                med = {k: median(v) * 1e6 for k, v in times.items()}
                rows.append(
                    {
                        "op": name,
                        "bytes": nbytes,
                        "iters": count,
                        **{f"{k}_us": v for k, v in med.items()},
                        "await/blocking": med["await"] / med["blocking"],
                        "await/torch": med["await"] / med["torch"],
                        "blocking/torch": med["blocking"] / med["torch"],
                        "wait/blocking": med["wait"] / med["blocking"],
                        "a/a": med["again"] / med["torch"],
                    }
                )
                kept.append(times)
        bar.close()
        if r == 0:  # after every timed op, and on the reporting rank only
            for row, times in zip(rows, kept, strict=True):
                for ratio, top, bottom in (
                    ("await/torch", "await", "torch"),
                    ("blocking/torch", "blocking", "torch"),
                    ("a/a", "again", "torch"),
                ):
                    row[f"{ratio} 90%"] = list(ratio_interval(times[top], times[bottom]))
        return rows

    return overlap.run(main(), loop=loop)  # type: ignore[arg-type]


def bench_concurrent_rank(n: int, reps: int, loop: str = "uvloop") -> list[dict[str, Any]]:
    """n small all_reduces in flight at once: overlap's against the backend's own (mpi4py
    ``Iallreduce`` x n + ``Waitall``, or torch's ``async_op=True`` works + ``wait``),
    interleaved ``reps`` times; medians in seconds. Two rows: awaited ``together`` (one
    ``collect_all``) and ``last first`` (the last op awaited alone, then the rest; raw: its
    ``Wait``, then the rest), where the awaited op waits behind n - 1 ops nobody awaits yet."""
    import overlap

    r = comm.get_rank()
    ts = [torch.full((4,), float(i + r)) for i in range(n)]

    def theirs(last_first: bool) -> None:
        if _on_mpi():
            MPI = _mpi()
            bufs = [t.numpy() for t in ts]
            reqs = [MPI.COMM_WORLD.Iallreduce(MPI.IN_PLACE, b, op=MPI.SUM) for b in bufs]
            if last_first:
                reqs[-1].Wait()
            MPI.Request.Waitall(reqs)
        else:
            import torch.distributed as dist

            works = [dist.all_reduce(t, async_op=True) for t in ts]
            if last_first:
                works[-1].wait()
            for w in works:
                w.wait()

    async def ours(last_first: bool) -> None:
        hs = [comm.all_reduce(t, async_op=True) for t in ts]
        if last_first:
            await hs.pop()
        await comm.collect_all(hs)

    line_up = _line_up()

    async def main() -> list[dict[str, Any]]:
        rows = []
        for order in ("together", "last first"):
            times: dict[str, list[float]] = {"ours": [], "raw": []}
            for _ in range(reps):
                line_up()
                t0 = time.perf_counter()
                await ours(order == "last first")
                times["ours"].append(time.perf_counter() - t0)
                line_up()
                t0 = time.perf_counter()
                theirs(order == "last first")
                times["raw"].append(time.perf_counter() - t0)
            o, t = median(times["ours"]), median(times["raw"])
            rows.append({"op": "all_reduce", "in_flight": n, "order": order, "reps": reps,
                         "ours_s": o, "raw_s": t, "ours/raw": o / t})  # fmt: skip
        return rows

    return overlap.run(main(), loop=loop)  # type: ignore[arg-type]


def ops_table(rows: list[dict[str, Any]], title: str, reference: str = "torch") -> Table:
    """The rows as a table; ``reference`` names the raw-backend column (torch or MPI)."""
    cols = [
        "op",
        "size",
        f"{reference} us",
        "blocking us",
        "wait us",
        "await us",
        "await/blocking",
        f"await/{reference}",
        "90%",
        f"blocking/{reference}",
        "90% ",
        "wait/blocking",
        "A/A",
        "90%  ",
    ]
    table = Table(cols, title=title)
    for row in rows:
        values = [
            row["op"],
            human_bytes(row["bytes"]),
            row["torch_us"],
            row["blocking_us"],
            row["wait_us"],
            row["await_us"],
            round(row["await/blocking"], 3),
            round(row["await/torch"], 3),
            interval_cell(row.get("await/torch 90%")),
            round(row["blocking/torch"], 3),
            interval_cell(row.get("blocking/torch 90%")),
            round(row["wait/blocking"], 3),
            round(row["a/a"], 3),
            interval_cell(row.get("a/a 90%")),
        ]
        table.add(**dict(zip(cols, values, strict=True)))
    return table


def busbw_allreduce(nbytes: int, seconds: float, world: int) -> float:
    """nccl-tests' bus bandwidth of an allreduce, GB/s: algbw x 2 (n-1)/n."""
    return nbytes / seconds / 1e9 * 2 * (world - 1) / world if seconds > 0 else 0.0


def bench_algorithms_rank(
    sizes: list[int], iters: int, warmup: int, algorithm: str, loop: str = "uvloop"
) -> list[dict[str, Any]]:
    """Native all_reduce vs ``algorithm`` (blocking and awaited), interleaved per iteration
    in :func:`_rotated`'s balanced order, each after :func:`_line_up`."""
    import overlap

    w = comm.get_world_size()
    line_up = _line_up()

    async def main() -> list[dict[str, Any]]:
        rows = []
        bar = Progress(len(sizes), enabled=comm.get_rank() == 0)
        for nbytes in sizes:
            bar.advance(f"{algorithm} {human_bytes(nbytes)}")
            t = torch.ones(max(nbytes // 4, 1))
            times: dict[str, list[float]] = {"native": [], "blocking": [], "await": []}
            for i in range(warmup + _iters_for(nbytes, iters)):
                for method in _rotated(list(times), i):
                    line_up()
                    t0 = time.perf_counter()
                    if method == "native":
                        comm.all_reduce(t)
                    elif method == "blocking":
                        comm.all_reduce(t, algorithm=algorithm)
                    else:
                        await comm.all_reduce(t, async_op=True, algorithm=algorithm)
                    if i >= warmup:
                        times[method].append(time.perf_counter() - t0)
            med = {k: median(v) for k, v in times.items()}
            rows.append(
                {
                    "bytes": nbytes,
                    "world": w,
                    "algorithm": algorithm,
                    **{f"{k}_us": v * 1e6 for k, v in med.items()},
                    f"{algorithm}/native": med["blocking"] / med["native"],
                    "await/native": med["await"] / med["native"],
                    "native_busbw": busbw_allreduce(nbytes, med["native"], w),
                    f"{algorithm}_busbw": busbw_allreduce(nbytes, med["blocking"], w),
                }
            )
        bar.close()
        return rows

    return overlap.run(main(), loop=loop)  # type: ignore[arg-type]


def _end_mpi_job_quietly() -> None:
    """Ctrl-C on an MPI rank of the benchmark: end the whole job now, with no word (the CLI
    says ``overlap: interrupted``). A peer may sit in MPI's own Wait (overlap's blocking
    path with no job timeout), where no signal reaches Python, and this rank would hang in
    MPI_Finalize waiting for it: measured (fifty-seventh session), Ctrl-C of ``overlap
    bench ops --backend mpi`` ended only after the CLI's 20 s grace and its SIGTERM. The
    uncaught-exception abort (overlap.comm.init) would do it too, with a log line from each
    rank and MPICH's own; here the abort's message goes to /dev/null."""
    import os
    import sys

    from overlap.comm.init import mpi_job_of_several

    MPI = mpi_job_of_several()
    if MPI is None:  # not an MPI rank (torchrun's), or not started yet
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    MPI.COMM_WORLD.Abort(130)


def main_mpi(argv: list[str] | None = None) -> None:
    """Entry point under a launcher: ``python -m overlap.bench.ops OPS SIZES ITERS WARMUP LOOP
    [BACKEND [JOB_TIMEOUT]]`` (mpiexec: mpi, the default; torchrun across namespace hosts:
    gloo; JOB_TIMEOUT: seconds, ``init_distributed(timeout=)``).

    Rank 0 prints one line ``RESULT <json rows>``. OPS ``concurrent``: SIZES are numbers of
    ops in flight and ITERS repetitions (:func:`bench_concurrent_rank`).
    """
    import json
    import sys

    import overlap

    args = sys.argv[1:] if argv is None else argv
    ops, sizes = args[0].split(","), [int(x) for x in args[1].split(",")]
    iters, warmup, loop = int(args[2]), int(args[3]), args[4]
    torch.set_num_threads(1)
    timeout = float(args[6]) if len(args) > 6 else None
    try:
        overlap.init_distributed(args[5] if len(args) > 5 else "mpi", timeout=timeout)
        if ops == ["concurrent"]:  # sizes: the numbers of ops in flight; iters: repetitions
            rows = [row for n in sizes for row in bench_concurrent_rank(n, iters, loop)]
        else:
            rows = bench_ops_rank(ops, sizes, iters, warmup, loop)
    except KeyboardInterrupt:
        _end_mpi_job_quietly()
        raise
    if timeout is not None:  # what the ranks ran under, as the backend holds it
        from overlap.comm import state

        held = getattr(state.active(), "timeout", None)
        for row in rows:
            row["job_timeout_s"] = held
    if comm.get_rank() == 0:
        sys.stdout.write("RESULT " + json.dumps(rows) + "\n")
        sys.stdout.flush()
    comm.destroy_process_group()


if __name__ == "__main__":  # run by the CLI as stopping.python_module(__name__, ...)
    main_mpi()
