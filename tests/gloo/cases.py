"""Rank-side functions for the gloo tests (importable, so RankPool can pickle them).

Each op case computes the expected result locally from rank and world size and asserts it;
an AssertionError travels back to the test with the failing rank's traceback.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import torch

import overlap
from overlap import comm

Issue = Callable[[bool], Any]


def go(issue: Issue, mode: str) -> Any:
    """Finish an op the way ``mode`` says: blocking, h.wait(), or awaited on a loop kind."""
    if mode == "blocking":
        return issue(False)
    if mode == "wait":
        h = issue(True)
        if isinstance(h, list):
            return [x.wait(timeout=60) for x in h]
        return h.wait(timeout=60)

    async def main() -> Any:
        h = issue(True)
        if isinstance(h, list):
            return await asyncio.gather(*h)
        return await h

    return overlap.run(main(), loop=mode)  # type: ignore[arg-type]


def rw() -> tuple[int, int]:
    return comm.get_rank(), comm.get_world_size()


def _allclose(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(a, b), f"{a.tolist()} != {b.tolist()}"


def case_all_reduce(mode: str) -> None:
    r, w = rw()
    t = torch.arange(5.0) + r
    out = go(lambda a: comm.all_reduce(t, async_op=a), mode)
    assert out is t
    # deepspeed.comm guide: arange(5)+rank on 4 ranks gives [6, 10, 14, 18, 22]
    _allclose(t, torch.arange(5.0) * w + w * (w - 1) / 2)


def case_all_reduce_ops(mode: str) -> None:
    r, w = rw()
    base = torch.tensor([r + 1.0, -(r + 1.0), 2.0])
    for op, want in [
        ("avg", torch.tensor([(w + 1) / 2, -(w + 1) / 2, 2.0])),
        ("max", torch.tensor([float(w), -1.0, 2.0])),
        ("min", torch.tensor([1.0, -float(w), 2.0])),
        (
            "product",
            torch.tensor(
                [
                    float(torch.arange(1, w + 1).prod()),
                    float(torch.arange(1, w + 1).prod()) * (-1) ** w,
                    2.0**w,
                ]
            ),
        ),
    ]:
        t = base.clone()
        go(lambda a, t=t, op=op: comm.all_reduce(t, op=op, async_op=a), mode)
        assert torch.allclose(t, want), (op, t, want)
    i = torch.tensor([1 << r, 3], dtype=torch.int64)
    go(lambda a: comm.all_reduce(i, op="bor", async_op=a), mode)
    assert i.tolist() == [(1 << w) - 1, 3]
    # bool sum and product are logical or and and, on gloo (which adds bools into a bool)
    # and on MPI alike; MPI refused them before
    for op, want_b in (("sum", [True, True, False]), ("product", [r == 0 and w == 1, True, False])):
        b = torch.tensor([r == 0, True, False])
        go(lambda a, b=b, op=op: comm.all_reduce(b, op=op, async_op=a), mode)
        assert b.tolist() == want_b, (op, b.tolist())
    b16 = torch.full((3,), float(r), dtype=torch.bfloat16)
    go(lambda a: comm.all_reduce(b16, op="sum", async_op=a), mode)
    assert b16.float().tolist() == [w * (w - 1) / 2] * 3


def case_max_min_nan(mode: str) -> None:
    """A max or min of floats with a NaN on any one rank is NaN on every rank, as
    torch.maximum/minimum: before, gloo dropped a NaN unless rank 0 held it, and MPICH gave
    the ranks different answers (overlap.comm.ordered). Finite values and infinities come out
    as torch.maximum/minimum folded over the ranks say, and -0.0 is below +0.0."""
    r, w = rw()
    nan, inf = float("nan"), float("inf")

    def mine(k: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
        # position 0: NaN on rank k; 1: rank-dependent finite; 2: signed zeros; 3: inf
        row = [nan if rank == k else rank + 0.5, -(rank * 1.5), -0.0 if rank % 2 else 0.0]
        return torch.tensor([*row, inf if rank == 0 else -inf], dtype=dtype)

    kinds = [
        (dtype, op, fold, alg)
        for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16)
        for op, fold in (("max", torch.maximum), ("min", torch.minimum))
        # ring and naive too (float32): they ended on the other zero than native's
        for alg in (("native", "ring", "naive") if dtype is torch.float32 else ("native",))
    ]
    for k in range(w):
        for dtype, op, fold, alg in kinds:
            want = mine(k, 0, dtype)
            for q in range(1, w):
                want = fold(want, mine(k, q, dtype))
            t = mine(k, r, dtype)
            go(lambda a, t=t, op=op, g=alg: comm.all_reduce(t, op, algorithm=g, async_op=a), mode)
            assert torch.isnan(t[0]), (k, dtype, op, alg, t.tolist())
            assert t[1:].tolist() == want[1:].tolist(), (k, dtype, op, alg, t, want)
            # -0.0 < +0.0 whatever the order (torch.maximum's pick depends on it)
            assert t[2].signbit().item() == (op == "min" and w > 1), (k, op, alg, t)
        # reduce: the result on dst, every other rank's tensor unchanged
        t = mine(k, r, torch.float32)
        go(lambda a, t=t: comm.reduce(t, dst=w - 1, op="max", async_op=a), mode)
        if r == w - 1:
            assert torch.isnan(t[0]) and t[1].item() == 0.0, t.tolist()
        else:
            assert t.tolist()[1:] == mine(k, r, torch.float32).tolist()[1:], t.tolist()
            assert torch.isnan(t[0]) == (r == k), t.tolist()
        # reduce_scatter, from chunks and from one flat tensor: rank j gets chunk j
        chunks = [torch.tensor([nan if r == k else float(r + j)]) for j in range(w)]
        flat = torch.cat(chunks)
        for data in (chunks, flat):
            out = torch.empty(1)
            go(
                lambda a, out=out, data=data: comm.reduce_scatter(out, data, "min", async_op=a),
                mode,
            )
            assert torch.isnan(out[0]), (k, out.tolist())
        assert flat.isnan().tolist() == [r == k] * w, flat.tolist()  # the input is left alone


def case_avg_float16_in_range(mode: str) -> None:
    """An average of float16 values is finite where the average is: each rank's share is
    summed (NCCL's pre-multiplied sum). Before, gloo and MPI summed first, so 40000 on
    every rank averaged to inf. Covers all_reduce (native, ring, naive), reduce and
    reduce_scatter; non-destination tensors and reduce_scatter's input stay as they were."""
    r, w = rw()
    big = 40000.0  # the sum of two is past float16's 65504

    def mine() -> torch.Tensor:
        return torch.tensor([big, -big, 0.5 * (r + 1)], dtype=torch.float16)

    want = torch.tensor([big, -big, 0.5 * (w + 1) / 2])

    def near(t: torch.Tensor) -> None:
        assert torch.isfinite(t).all(), t.tolist()
        torch.testing.assert_close(t.float(), want, rtol=2e-3, atol=1e-3)

    for algorithm in ("native", "ring", "naive"):
        t = mine()
        go(lambda a, t=t, alg=algorithm: comm.all_reduce(t, "avg", algorithm=alg, async_op=a), mode)
        near(t)
    t = mine()
    go(lambda a: comm.reduce(t, dst=w - 1, op="avg", async_op=a), mode)
    if r == w - 1:
        near(t)
    else:
        assert torch.equal(t, mine()), t.tolist()
    chunks = [mine() for _ in range(w)]
    flat = torch.cat(chunks)
    for data in (chunks, flat):
        out = torch.empty(3, dtype=torch.float16)
        go(lambda a, out=out, data=data: comm.reduce_scatter(out, data, "avg", async_op=a), mode)
        near(out)
    assert torch.equal(flat, torch.cat([mine()] * w)), flat.tolist()  # the input is left alone
    assert all(torch.equal(c, mine()) for c in chunks)


def case_parameters_as_outputs(mode: str) -> None:
    """Parameters (leaves that require grad) as the outputs of the list collectives and the
    coalesced ones take the result in place, as the single-tensor collectives did: the copy
    into them raised "a leaf Variable that requires grad is being used in an in-place
    operation" once the data had arrived. The result is the caller's own list."""
    r, w = rw()

    def param(n: int, v: float) -> torch.nn.Parameter:
        return torch.nn.Parameter(torch.full((n,), v))

    ps = [param(2, float(r)), param(3, float(r + 1))]
    assert go(lambda a: comm.all_reduce_coalesced(ps, op="avg", async_op=a), mode) is ps
    assert [p.tolist() for p in ps] == [[(w - 1) / 2] * 2, [(w + 1) / 2] * 3]
    outs = [param(1, -1.0) for _ in range(w)]
    assert go(lambda a: comm.all_gather(outs, torch.tensor([float(r)]), async_op=a), mode) is outs
    assert [o.tolist() for o in outs] == [[float(i)] for i in range(w)]
    outs = [param(1, -1.0) for _ in range(w)]
    ins = [torch.tensor([float(10 * r + j)]) for j in range(w)]
    assert go(lambda a: comm.all_to_all(outs, ins, async_op=a), mode) is outs
    assert [o.tolist() for o in outs] == [[float(10 * j + r)] for j in range(w)]
    outs = [param(1, -1.0) for _ in range(w)]
    got = go(
        lambda a: comm.gather(
            torch.tensor([float(r)]), outs if r == 0 else None, dst=0, async_op=a
        ),
        mode,
    )
    if r == 0:
        assert got is outs and [o.tolist() for o in outs] == [[float(i)] for i in range(w)]
    outs = [param(w, -1.0)]
    go(lambda a: comm.all_gather_coalesced(outs, [torch.tensor([float(r)])], async_op=a), mode)
    assert outs[0].tolist() == [float(i) for i in range(w)]
    assert all(o.requires_grad and o.grad_fn is None for o in [*ps, *outs])


def case_broadcast(mode: str) -> None:
    r, w = rw()
    t = torch.full((4,), float(r))
    assert go(lambda a: comm.broadcast(t, src=w - 1, async_op=a), mode) is t
    _allclose(t, torch.full((4,), float(w - 1)))
    # every root in turn, twice: the options made once per root must say the root asked for
    for src in [*range(w), *reversed(range(w))]:
        t.fill_(float(r * 10 + src))
        go(lambda a, src=src: comm.broadcast(t, src=src, async_op=a), mode)
        _allclose(t, torch.full((4,), float(src * 10 + src)))


def case_reduce(mode: str) -> None:
    r, w = rw()
    t = torch.arange(3.0) + r
    before = t.clone()
    go(lambda a: comm.reduce(t, dst=w - 1, async_op=a), mode)
    if r == w - 1:
        _allclose(t, torch.arange(3.0) * w + w * (w - 1) / 2)
    else:
        _allclose(t, before)  # unchanged on non-destination ranks (gloo leaves partial sums)
    t2 = torch.full((2,), float(r))
    go(lambda a: comm.reduce(t2, dst=0, op="avg", async_op=a), mode)
    if r == 0:
        _allclose(t2, torch.full((2,), (w - 1) / 2))


def case_all_gather(mode: str) -> None:
    r, w = rw()
    t = torch.full((2,), float(r))
    outs = [torch.empty(2) for _ in range(w)]
    got = go(lambda a: comm.all_gather(outs, t, async_op=a), mode)
    assert got is outs
    for i, o in enumerate(outs):
        _allclose(o, torch.full((2,), float(i)))
    got2 = go(lambda a: comm.all_gather(t, async_op=a), mode)
    assert [o.tolist() for o in got2] == [[float(i)] * 2 for i in range(w)]


def case_all_gather_into_tensor(mode: str) -> None:
    r, w = rw()
    out = torch.empty(2 * w)
    got = go(
        lambda a: comm.all_gather_into_tensor(out, torch.full((2,), float(r)), async_op=a), mode
    )
    assert got is out
    _allclose(out, torch.arange(w).repeat_interleave(2).float())


def case_reduce_scatter(mode: str) -> None:
    r, w = rw()
    chunks = [torch.full((2,), float(r * 10 + j)) for j in range(w)]
    want = torch.full((2,), 10.0 * w * (w - 1) / 2 + w * r)
    out = torch.empty(2)
    assert go(lambda a: comm.reduce_scatter(out, chunks, async_op=a), mode) is out
    _allclose(out, want)
    out2 = torch.empty(2)
    flat = torch.cat(chunks)
    go(lambda a: comm.reduce_scatter(out2, flat, async_op=a), mode)
    _allclose(out2, want)
    out3 = torch.empty(2)
    go(lambda a: comm.reduce_scatter_tensor(out3, flat, op="avg", async_op=a), mode)
    _allclose(out3, want / w)


def case_shapes_by_element_count(mode: str) -> None:
    """all_gather_into_tensor's output and reduce_scatter's input may be stacked
    (world, *shape), concatenated (world * rows, ...) or flat, and reduce_scatter's chunks
    any shape with the output's element count, as NCCL and MPI take them (torch documents
    the stacked form). Before, gloo refused all but the concatenation ("invalid tensor
    size", "Check failed: outputShape[0] * worldSize == inputShape[0]")."""
    r, w = rw()
    x = torch.arange(4.0).reshape(2, 2) + 10 * r
    want = torch.cat([torch.arange(4.0) + 10 * k for k in range(w)])
    for shape in ((w, 2, 2), (2 * w, 2), (4 * w,), (2, 2 * w)):
        out = torch.empty(shape)
        assert go(lambda a, out=out: comm.all_gather_into_tensor(out, x, async_op=a), mode) is out
        _allclose(out.flatten(), want)
    grid = torch.arange(4.0 * w).reshape(w, 2, 2) + r  # rank j gets grid[j] summed
    summed = torch.arange(4.0 * w).reshape(w, 2, 2)[r] * w + w * (w - 1) / 2
    for data in (grid, grid.flatten(), list(grid.reshape(w, 4))):
        out = torch.empty(2, 2)
        go(lambda a, out=out, d=data: comm.reduce_scatter(out, d, async_op=a), mode)
        _allclose(out, summed)
    out = torch.empty(2, 2)
    go(lambda a: comm.reduce_scatter_tensor(out, grid, op="max", async_op=a), mode)
    _allclose(out, torch.arange(4.0 * w).reshape(w, 2, 2)[r] + w - 1)
    assert torch.equal(grid, torch.arange(4.0 * w).reshape(w, 2, 2) + r)  # input left alone


def case_all_to_all_single(mode: str) -> None:
    r, w = rw()
    inp = torch.arange(2.0 * w) + 100 * r
    out = torch.empty(2 * w)
    assert go(lambda a: comm.all_to_all_single(out, inp, async_op=a), mode) is out
    want = torch.cat([torch.tensor([100.0 * q + 2 * r, 100.0 * q + 2 * r + 1]) for q in range(w)])
    _allclose(out, want)
    # uneven splits: rank q sends q+1 elements to everyone
    inp2 = torch.full(((r + 1) * w,), float(r))
    out2 = torch.empty(sum(q + 1 for q in range(w)))
    go(
        lambda a: comm.all_to_all_single(
            out2, inp2, [q + 1 for q in range(w)], [r + 1] * w, async_op=a
        ),
        mode,
    )
    _allclose(out2, torch.cat([torch.full((q + 1,), float(q)) for q in range(w)]))


def case_all_to_all(mode: str) -> None:
    r, w = rw()
    ins = [torch.full((1,), float(r * 10 + j)) for j in range(w)]
    outs = [torch.empty(1) for _ in range(w)]
    go(lambda a: comm.all_to_all(outs, ins, async_op=a), mode)
    assert [o.item() for o in outs] == [float(q * 10 + r) for q in range(w)]
    # uneven, as MoE's token exchange: rank q sends rank j (q + j) % 3 rows of width 2, in
    # float64 to rank 0; gloo's own refused lists of several shapes
    n = [[(q + j) % 3 for j in range(w)] for q in range(w)]

    def dt(j: int) -> torch.dtype:
        return torch.float64 if j == 0 else torch.float32

    ins = [torch.full((n[r][j], 2), float(r * 10 + j), dtype=dt(j)) for j in range(w)]
    outs = [torch.full((n[q][r], 2), -1.0, dtype=dt(r)) for q in range(w)]
    go(lambda a: comm.all_to_all(outs, ins, async_op=a), mode)
    for q, o in enumerate(outs):
        assert o.tolist() == [[float(q * 10 + r)] * 2] * n[q][r], (q, o.tolist())


def case_gloo_fallbacks(mode: str) -> None:
    """reduce_scatter built from ops gloo has (overlap.comm.gloo_fallback), as on a torch
    whose gloo lacks it (2.2), and all_to_all, which takes that path on every gloo: the same
    results as the native ops, also for an all_to_all of mixed dtypes and uneven sizes.
    Elsewhere (MPI) the native ops."""
    from overlap.comm import gloo_fallback

    forced = comm.get_backend() == "gloo" and not gloo_fallback.LACKING
    if forced:
        gloo_fallback.LACKING.update(["reduce_scatter", "reduce_scatter_flat"])
    try:
        case_reduce_scatter(mode)
        case_all_to_all(mode)
        if forced:
            r, w = rw()

            def kind(to: int) -> torch.dtype:  # what rank `to` receives, from every rank
                return torch.float64 if to % 2 else torch.int32

            ins = [torch.full((j + 1,), r * 10 + j, dtype=kind(j)) for j in range(w)]
            outs = [torch.full((r + 1,), -1, dtype=kind(r)) for _ in range(w)]
            got = go(lambda a: comm.all_to_all(outs, ins, async_op=a), mode)
            assert got is outs or mode == "blocking", got
            for q, o in enumerate(outs):
                assert o.dtype == kind(r) and o.tolist() == [q * 10 + r] * (r + 1), (q, o)
            # the inputs are left as they were (reduce_scatter reduces a copy)
            flat = torch.arange(2.0 * w)
            comm.reduce_scatter(torch.empty(2), flat)
            assert flat.tolist() == [float(i) for i in range(2 * w)]
    finally:
        if forced:
            gloo_fallback.LACKING.clear()


def case_torch_wrappers(mode: str) -> None:
    """all_gather_into_tensor, reduce_scatter of a flat tensor and all_to_all_single through
    torch's Python wrappers, as on a torch that refuses the process group's own calls
    (overlap.comm.torch_backend._direct_first): the same results as the direct calls.
    Elsewhere (MPI) the backend's own ops again."""
    from overlap.comm import torch_backend

    forced = comm.get_backend() == "gloo" and not torch_backend.NO_DIRECT
    if forced:
        torch_backend.NO_DIRECT.update(
            ["all_gather_into_tensor", "reduce_scatter_flat", "all_to_all_single"]
        )
    try:
        case_all_gather_into_tensor(mode)
        case_reduce_scatter(mode)
        case_all_to_all_single(mode)
    finally:
        if forced:
            torch_backend.NO_DIRECT.clear()


def case_gather(mode: str) -> None:
    r, w = rw()
    gl = [torch.empty(2) for _ in range(w)] if r == 0 else None
    got = go(lambda a: comm.gather(torch.full((2,), float(r)), gl, dst=0, async_op=a), mode)
    if r == 0:
        assert got is gl and [g.tolist() for g in gl] == [[float(i)] * 2 for i in range(w)]
    else:
        assert got is None


def case_scatter(mode: str) -> None:
    r, w = rw()
    sl = [torch.full((3,), float(i * i)) for i in range(w)] if r == w - 1 else None
    t = torch.empty(3)
    go(lambda a: comm.scatter(t, sl, src=w - 1, async_op=a), mode)
    _allclose(t, torch.full((3,), float(r * r)))


def case_any_dtype_moves(mode: str) -> None:
    """Ops that only move data take every dtype on every backend: gloo has no int16,
    unsigned 16/32/64-bit or float8 type, and refused them even for a broadcast or a send,
    where MPI moved them (gloo now moves their bytes); gloo's gather refused complex tensors
    ("Invalid scalar type"). A reduction of a dtype torch cannot add on the CPU is refused on
    every rank before anything is sent with ring and naive: with naive, the root failed
    after its receives and the other ranks waited for the result until the job timeout."""
    from overlap.dtypes import float8_dtypes, present

    r, w = rw()
    for dt in [*present("int16", "uint16", "uint32", "uint64"), *float8_dtypes(), torch.complex64]:

        def mk(n: int, base: int, dt: torch.dtype = dt) -> torch.Tensor:
            x = torch.arange(n, dtype=torch.float32) + base
            return (x + 1j * x).to(dt) if dt.is_complex else x.to(dt)

        def same(a: torch.Tensor, b: torch.Tensor, dt: torch.dtype = dt) -> None:
            assert a.dtype == b.dtype == dt and a.shape == b.shape, (dt, a, b)
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (dt, a, b)

        t = mk(3, 10 * r)
        go(lambda a, t=t: comm.broadcast(t, src=w - 1, async_op=a), mode)
        same(t, mk(3, 10 * (w - 1)))
        out = torch.empty(w, 3, dtype=dt)
        go(lambda a, out=out: comm.all_gather_into_tensor(out, mk(3, 10 * r), async_op=a), mode)
        same(out, torch.stack([mk(3, 10 * k) for k in range(w)]))
        outs = [torch.empty(3, dtype=dt) for _ in range(w)]
        go(lambda a, outs=outs: comm.all_gather(outs, mk(3, 10 * r), async_op=a), mode)
        for k in range(w):
            same(outs[k], mk(3, 10 * k))
        # rows of 2: the split sizes count rows, as for any other dtype
        rows = torch.empty(w, 2, dtype=dt)
        ins = mk(2 * w, 10 * r).view(w, 2)
        go(lambda a, rows=rows, ins=ins: comm.all_to_all_single(rows, ins, async_op=a), mode)
        same(rows, torch.stack([mk(2 * w, 10 * k).view(w, 2)[r] for k in range(w)]))
        gl = [torch.empty(2, dtype=dt) for _ in range(w)] if r == 0 else None
        go(lambda a, gl=gl: comm.gather(mk(2, 10 * r), gl, dst=0, async_op=a), mode)
        if gl is not None:
            for k in range(w):
                same(gl[k], mk(2, 10 * k))
        got = torch.empty(2, dtype=dt)
        sl = [mk(2, 10 * k) for k in range(w)] if r == 0 else None
        go(lambda a, got=got, sl=sl: comm.scatter(got, sl, src=0, async_op=a), mode)
        same(got, mk(2, 10 * r))
        if w > 1:  # a pair around the ring, blocking (the other modes await p2p elsewhere)
            back = torch.empty(3, dtype=dt)
            hs = [comm.irecv(back, (r - 1) % w), comm.isend(mk(3, 10 * r), (r + 1) % w)]
            for h in hs:
                h.wait(timeout=60)
            same(back, mk(3, 10 * ((r - 1) % w)))
    for dt in present("uint16"):
        for algorithm in ("ring", "naive"):
            t = torch.ones(4, dtype=dt)
            try:
                go(lambda a, t=t, g=algorithm: comm.all_reduce(t, algorithm=g, async_op=a), mode)
                raise AssertionError(f"{algorithm} all_reduce of {dt} was accepted")
            except TypeError as exc:
                assert "torch cannot reduce them" in str(exc), exc
            assert torch.equal(t, torch.ones(4, dtype=dt))
    t = torch.ones(2)
    go(lambda a: comm.all_reduce(t, async_op=a), mode)  # the group is still in step
    _allclose(t, torch.full((2,), float(w)))


def case_get_future(mode: str) -> None:
    """A handle's ``get_future()`` (torch Work's) completes with the op; ``then`` chains,
    as a DDP comm hook does, including one that issues the next collective from the
    callback (PowerSGD's hook): it raised AttributeError."""
    r, w = rw()
    t = torch.full((3,), float(r + 1))
    fut = comm.all_reduce(t, async_op=True).get_future()
    mean = fut.then(lambda f: f.value()[0] / w)
    want = torch.full((3,), (w + 1) / 2)
    _allclose(mean.wait(), want)
    u = torch.full((2,), float(r))
    second: list[Any] = []

    def chain(f: Any) -> Any:
        h = comm.all_reduce(u, op="max", async_op=True)
        second.append(h)
        return f.value()[0].sum()

    total = comm.all_reduce(torch.ones(4), async_op=True).get_future().then(chain)
    assert float(total.wait()) == 4.0 * w
    go(lambda a: second[0] if a else second[0].wait(timeout=60), mode)
    _allclose(u, torch.full((2,), float(w - 1)))
    got = comm.all_gather(torch.tensor([float(r)]), async_op=True).get_future().wait()
    assert [g.tolist() for g in got] == [[float(k)] for k in range(w)]


def case_in_flight_same_memory(mode: str) -> None:
    """Ops issued on memory that a collective in flight writes (or reads, when they write
    it) run after it, as NCCL's stream gives (overlap.comm.claims): before, gloo's thread
    pool and MPI's nonblocking collectives raced on the buffer (two sums of ones gave 3 on
    gloo, a broadcast then a sum gave the two MPI ranks 4 and 2)."""
    r, w = rw()
    a = mode != "blocking"  # blocking: the same async ops, each finished by wait()

    def finish(hs: list[Any]) -> None:
        go(lambda _: hs, mode if a else "wait")

    for n in (2, 1 << 15):
        t = torch.ones(n)
        finish([comm.all_reduce(t, async_op=True), comm.all_reduce(t, async_op=True)])
        _allclose(t, torch.full((n,), float(w * w)))
        t = torch.full((n,), float(r + 1))
        finish([comm.broadcast(t, src=w - 1, async_op=True), comm.all_reduce(t, async_op=True)])
        _allclose(t, torch.full((n,), float(w * w)))
        # two overlapping views: the middle is summed twice, the ends once
        t = torch.ones(2 * n)
        h1 = comm.all_reduce(t[: n + n // 2], async_op=True)
        finish([h1, comm.all_reduce(t[n // 2 :], async_op=True)])
        want = torch.full((2 * n,), float(w))
        want[n // 2 : n + n // 2] = w * w
        _allclose(t, want)
        if w > 1:
            # a send of a tensor an all_reduce in flight writes sends the sum: the send
            # waits for the collective (before, it could send the tensor unreduced)
            nxt, prv = (r + 1) % w, (r - 1) % w
            t = torch.full((n,), float(r + 1))
            got = torch.zeros(n)
            h = comm.all_reduce(t, async_op=True)
            finish([h, comm.irecv(got, src=prv), comm.isend(t, dst=nxt)])
            _allclose(got, torch.full((n,), float(w * (w + 1) / 2)))


def case_barrier(mode: str) -> None:
    assert go(lambda a: comm.barrier(async_op=a), mode) is None


def case_p2p(mode: str) -> None:
    r, w = rw()
    if w == 1:
        return
    nxt, prv = (r + 1) % w, (r - 1) % w
    buf = torch.empty(3)
    payload = torch.full((3,), float(r))
    if mode == "blocking":
        # even ranks send first, odd ranks receive first: no deadlock for any world size
        if r % 2 == 0:
            comm.send(payload, dst=nxt)
            assert comm.recv(buf, src=prv) == prv
        else:
            assert comm.recv(buf) == prv  # any source
            comm.send(payload, dst=nxt)
    else:
        go(lambda a: [comm.irecv(buf, src=prv), comm.isend(payload, dst=nxt, tag=0)], mode)
    _allclose(buf, torch.full((3,), float(prv)))


def case_batch_isend_irecv(mode: str) -> None:
    r, w = rw()
    if w == 1:
        return
    nxt, prv = (r + 1) % w, (r - 1) % w
    buf = torch.empty(2)
    ops = [comm.P2POp("isend", torch.full((2,), float(r)), nxt), comm.P2POp(comm.irecv, buf, prv)]
    if mode == "blocking":
        hs = comm.batch_isend_irecv(ops)
        for h in hs:
            h.wait(timeout=60)
    else:
        go(lambda a: comm.batch_isend_irecv(ops), mode)
    _allclose(buf, torch.full((2,), float(prv)))


def case_sendrecv(mode: str) -> None:
    """comm.sendrecv round a ring: the received values and sender, round after round on the
    same tensors (the kept exchange from the second), and the same objects changed in place
    since (another storage, another size: the kept addresses and sizes must not be used), an
    in-place exchange (the send is a copy), a receive from any rank, and with a tracer
    attached (the composed form: the tracer sees the receive and the send)."""
    r, w = rw()
    if w == 1:
        return
    nxt, prv = (r + 1) % w, (r - 1) % w
    send, recv = torch.zeros(4), torch.zeros(4)
    holder: list[Any] = []

    def exchange(s: torch.Tensor, d: torch.Tensor, src: Any = prv, tag: int = 0) -> Any:
        def issue(a: bool) -> Any:
            out = comm.sendrecv(s, nxt, d, src, tag=tag, async_op=a)
            if a:
                holder[:] = [out]
            return out

        got = go(issue, mode)
        assert got is d, "sendrecv resolves to the receive tensor"
        if mode != "blocking":
            assert holder[0].source == prv, holder[0].source
        return got

    # Refused calls post nothing: a send posted before the refusal would land in the
    # peer's next receive (999 where 0 + prv belongs).
    bad = torch.full((4,), 999.0)
    for kwargs, err in (
        ({"src": r}, ValueError),  # from itself
        ({"src": w}, ValueError),  # not a rank
        ({"recv_tensor": [recv]}, TypeError),
        ({"tag": -1}, ValueError),
    ):
        call = {"send_tensor": bad, "dst": nxt, "recv_tensor": recv, "src": prv, **kwargs}
        try:
            comm.sendrecv(**call)
        except err:
            pass
        else:
            raise AssertionError(f"sendrecv{kwargs} was not refused")
    for i in range(3):
        send.fill_(float(10 * i + r))
        exchange(send, recv)
        _allclose(recv, torch.full((4,), float(10 * i + prv)))
    recv.set_(torch.zeros(4))  # another storage under the same object
    send.fill_(float(50 + r))
    exchange(send, recv)
    _allclose(recv, torch.full((4,), float(50 + prv)))
    old = send.view_as(send)  # keeps the old storage (50 + r) alive: a stale send shows
    send.set_(torch.full((4,), float(55 + r)))
    exchange(send, recv)
    _allclose(recv, torch.full((4,), float(55 + prv)))
    del old
    send.resize_(6).fill_(float(60 + r))  # another size (and address) on the same objects
    recv.resize_(6)
    exchange(send, recv)
    _allclose(recv, torch.full((6,), float(60 + prv)))
    t = torch.full((3,), float(r))
    exchange(t, t)  # in place: a copy of t is sent
    _allclose(t, torch.full((3,), float(prv)))
    leaf = torch.zeros(3, requires_grad=True)  # received through a detached view: still
    exchange(torch.full((3,), float(r), requires_grad=True), leaf)  # the caller's tensor
    _allclose(leaf.detach(), torch.full((3,), float(prv)))
    anyone = torch.zeros(2)
    exchange(torch.full((2,), float(r)), anyone, None, 7)
    _allclose(anyone, torch.full((2,), float(prv)))
    with overlap.Tracer() as tracer:
        send.fill_(float(70 + r))
        exchange(send, recv)
    _allclose(recv, torch.full((6,), float(70 + prv)))
    names = sorted({span[0] for span in tracer.spans})
    assert "irecv" in names and "isend" in names, names
    if w >= 3:  # a sub-group of ranks 0 and 1 (global ranks), twice: kept, then destroyed
        g = comm.new_group([0, 1])
        for i in range(2):
            if r < 2:
                mine, theirs = torch.full((2,), float(80 + i + r)), torch.zeros(2)
                assert comm.sendrecv(mine, 1 - r, theirs, 1 - r, group=g) is theirs
                _allclose(theirs, torch.full((2,), float(80 + i + 1 - r)))
        comm.destroy_process_group(g)


def case_irecv_source(mode: str) -> None:
    """Handle.source names the rank whose message landed: from any rank (``src=None``,
    torch's ``Work._source_rank()``, MPI's status) and from the one asked for, in a batch
    too. Before, an ``irecv(src=None)`` gave no way to learn who had sent."""
    r, w = rw()
    if w == 1:
        return
    nxt, prv = (r + 1) % w, (r - 1) % w
    bufs = [torch.zeros(2), torch.zeros(2), torch.zeros(2)]
    handles: list[Any] = []

    def issue(_: bool) -> Any:
        handles[:] = [
            comm.irecv(bufs[0], tag=41),
            comm.irecv(bufs[1], src=prv, tag=42),
            *comm.batch_isend_irecv([comm.P2POp("irecv", bufs[2], prv, tag=43)]),
        ]
        assert all(h.source is None for h in handles if not h.done()), handles
        handles.append(comm.isend(torch.full((2,), float(r)), dst=nxt, tag=41))
        handles.append(comm.isend(torch.full((2,), float(r)), dst=nxt, tag=42))
        handles.append(comm.isend(torch.full((2,), float(r)), dst=nxt, tag=43))
        return handles

    if mode == "blocking":
        for h in issue(True):
            h.wait(timeout=60)
    else:
        go(issue, mode)
    for b in bufs:
        _allclose(b, torch.full((2,), float(prv)))
    assert [h.source for h in handles] == [prv, prv, prv, None, None, None], handles
    # torch Work's names: the sender, and success
    assert [h.source_rank() for h in handles[:3]] == [prv, prv, prv]
    assert all(h.is_success() for h in handles)
    try:
        handles[3].source_rank()  # a send names no sender
        raise AssertionError("source_rank() of a send answered")
    except RuntimeError as exc:
        assert "not a receive" in str(exc), exc


def case_empty_receive_from_any_rank(mode: str) -> None:
    """An empty tensor received from any rank (``src=None``): the sender is named, and the
    next exchange on the same tag lands whole. Before, gloo failed its own check in
    ``recv_anysource`` ("offset < this->size. 0 vs 0"): irecv raised that, and the blocking
    recv left its peer waiting (found by a differential fuzz, forty-sixth session)."""
    r, w = rw()
    if w == 1:
        return
    nxt, prv = (r + 1) % w, (r - 1) % w
    empty, got = torch.empty(0), torch.zeros(3)
    if mode == "blocking":
        if r % 2 == 0:  # an odd world's last rank sends to rank 0, also even: it goes first
            comm.send(torch.empty(0), nxt, tag=44)
            sender = comm.recv(empty, tag=44)
        else:
            sender = comm.recv(empty, tag=44)
            comm.send(torch.empty(0), nxt, tag=44)
        assert sender == prv, (sender, prv)
    else:
        hs: list[Any] = []

        def issue(_: bool) -> Any:
            hs[:] = [comm.irecv(empty, tag=44), comm.isend(torch.empty(0), nxt, tag=44)]
            return hs

        go(issue, mode)
        assert hs[0].source == prv, (hs[0].source, prv)
    assert empty.shape == (0,)
    hs2 = [comm.irecv(got, src=prv, tag=44), comm.isend(torch.full((3,), float(r)), nxt, tag=44)]
    for h in hs2:
        h.wait(timeout=60)
    _allclose(got, torch.full((3,), float(prv)))


def case_complex_product(mode: str) -> None:
    """The product of complex tensors, as complex numbers multiply, on every backend:
    all_reduce, reduce (other ranks' tensors unchanged) and reduce_scatter (flat and list).
    Before, gloo refused all three (torch reduces complex tensors as real pairs, so it
    refuses a product): all_reduce and reduce_scatter with torch's ValueError, reduce with a
    CommError that said to upgrade torch, where MPI gave the product."""
    r, w = rw()

    def mine(k: int, n: int) -> torch.Tensor:  # rank k's values: small Gaussian integers
        re = torch.arange(n, dtype=torch.float32) % 3 - 1 + k
        return torch.complex(re, torch.arange(n, dtype=torch.float32) % 2 + 1 - k)

    def product(xs: list[torch.Tensor]) -> torch.Tensor:
        acc = xs[0].clone()
        for x in xs[1:]:
            acc = acc * x
        return acc

    want = product([mine(k, 5) for k in range(w)])
    t = mine(r, 5)
    assert go(lambda a: comm.all_reduce(t, "product", async_op=a), mode) is t
    _allclose(t, want)
    t = mine(r, 5)
    go(lambda a: comm.reduce(t, w - 1, "product", async_op=a), mode)
    _allclose(t, want if r == w - 1 else mine(r, 5))
    flat, out = mine(r, 2 * w), torch.zeros(2, dtype=torch.complex64)
    go(lambda a: comm.reduce_scatter_tensor(out, flat, "product", async_op=a), mode)
    _allclose(out, product([mine(k, 2 * w)[2 * r : 2 * r + 2] for k in range(w)]))
    parts, out2 = list(mine(r, 2 * w).view(w, 2).clone()), torch.zeros(2, dtype=torch.complex64)
    go(lambda a: comm.reduce_scatter(out2, parts, "product", async_op=a), mode)
    _allclose(out2, out)


def case_collect_all(mode: str) -> None:
    """collect_all over the real backend: sixteen collectives and a ring exchange in one
    Handle, waited or awaited; the result is each op's own result, in issue order."""
    r, w = rw()
    nxt, prv = (r + 1) % w, (r - 1) % w
    if mode == "blocking":
        return
    ts = [torch.full((4,), float(r + i)) for i in range(16)]
    buf = torch.empty(3)

    def issue(_: bool) -> Any:
        hs = [comm.all_reduce(t, async_op=True) for t in ts]
        if w > 1:
            hs += [comm.irecv(buf, src=prv), comm.isend(torch.full((3,), float(r)), dst=nxt)]
        return comm.collect_all(hs)

    out = go(issue, mode)
    total = sum(range(w))
    assert len(out) == 16 + (2 if w > 1 else 0)
    for i, t in enumerate(ts):
        assert out[i] is t
        _allclose(t, torch.full((4,), float(total + w * i)))
    if w > 1:
        _allclose(buf, torch.full((3,), float(prv)))


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


def run_case(name: str, mode: str) -> str:
    CASES[name](mode)
    return name


def run_cases(mode: str) -> list[str]:
    """All cases in one call (keeps the world-size sweep cheap)."""
    return [run_case(name, mode) for name in CASES]
