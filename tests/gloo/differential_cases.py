"""A differential check of every op of ``overlap.comm`` against a reference each rank
computes itself (forty-sixth session; it found the empty receive from any rank and the
complex product on gloo).

Every rank generates every rank's inputs from (seed, op index, rank), so the expected
result is known locally: a random op (each collective, p2p, batch, object and coalesced
call), dtype (ten, complex included), shape (0-d, empty, odd, 2-D), group (the world and,
on 3 ranks, three pairs) and way to finish it (blocking, ``wait()``, ``await``). Tensors
come from a pool and are often the same object again, with new contents or as another
dtype's view of the same storage, so the backends' caches of calls seen before are
exercised. Values are small integers, so every reduction is exact in every dtype.
Returns the mismatches, none when all is well.
"""

from __future__ import annotations

import random
from typing import Any

import torch

import overlap
from overlap import comm

__all__ = ["run"]

DT = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]
FLOATS = {torch.float32, torch.float64, torch.float16, torch.bfloat16}


def gen(
    seed: int, i: int, r: int, shape: tuple[int, ...], dt: torch.dtype, salt: int = 0
) -> torch.Tensor:
    """Rank ``r``'s input of op ``i``: small integers (exact in every dtype)."""
    g = torch.Generator().manual_seed((seed * 1000003 + i * 1009 + r * 7 + salt) % (2**62))
    if dt is torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    lo, hi = (0, 4) if dt is torch.uint8 else (-3, 4)
    if dt is torch.complex64:
        re = torch.randint(lo, hi, shape, generator=g).float()
        im = torch.randint(lo, hi, shape, generator=g).float()
        return torch.complex(re, im)
    return torch.randint(lo, hi, shape, generator=g).to(dt)


def fold(op: str, xs: list[torch.Tensor]) -> torch.Tensor:
    """The reduction ``op`` of ``xs`` in rank order (bool: logical or/and)."""
    acc = xs[0].clone()
    for x in xs[1:]:
        b = acc.dtype is torch.bool
        if op == "sum":
            acc = (acc | x) if b else acc + x
        elif op == "product":
            acc = (acc & x) if b else acc * x
        elif op == "max":
            acc = torch.maximum(acc, x)
        elif op == "min":
            acc = torch.minimum(acc, x)
        elif op == "band":
            acc = acc & x
        elif op == "bor":
            acc = acc | x
        elif op == "bxor":
            acc = acc ^ x
        elif op == "avg":
            acc = acc + x
    if op == "avg":
        wide = torch.complex128 if acc.is_complex() else torch.float64
        acc = (acc.to(wide) / len(xs)).to(acc.dtype)
    return acc


class Pool:
    """Reuses tensor objects: same (shape, dtype) -> often the same object, content replaced."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.d, self.used = rng, {}, set()

    def reset(self) -> None:
        self.used = set()

    def get(
        self, shape: tuple[int, ...], dt: torch.dtype, fill: torch.Tensor | None = None
    ) -> torch.Tensor:
        k = (shape, dt)
        t = self.d.get(k)
        choice = self.rng.random()
        if t is None or choice < 0.3:
            t = torch.empty(shape, dtype=dt)
            self.d[k] = t
        elif choice < 0.4 and dt in (torch.float32, torch.int32) and len(shape) == 1:
            # a dtype view of another pooled tensor's storage: same address, other dtype
            other = torch.int32 if dt is torch.float32 else torch.float32
            base = self.d.get((shape, other))
            if base is not None:
                t = base.view(dt)
        if t.untyped_storage().data_ptr() in self.used and t.numel():
            t = torch.empty(shape, dtype=dt)
        self.used.add(t.untyped_storage().data_ptr())
        if fill is not None:
            t.copy_(fill)
        else:
            t.fill_(0 if dt is not torch.bool else False)
        return t


def same(a: torch.Tensor, b: torch.Tensor, tol: bool = False) -> bool:
    """Equal in shape, dtype and bits (``tol``: within 2%, for an average)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if tol:
        wide = torch.complex128 if a.is_complex() else torch.float64
        return torch.allclose(a.to(wide), b.to(wide), atol=0.02, rtol=0.02)
    return torch.equal(a, b)


async def finish(h: Any, mode: str) -> None:
    """End an op as ``mode`` says (a blocking call has ended already)."""
    if mode == "blocking" or h is None:
        return
    if isinstance(h, list):
        if mode == "wait":
            for x in h:
                x.wait()
        else:
            await comm.collect_all(h)
        return
    if mode == "wait":
        h.wait()
    else:
        await h


def run(seed: int, nops: int) -> list[str]:
    """``nops`` random ops from ``seed`` (the same on every rank); the mismatches."""
    r, w = comm.get_rank(), comm.get_world_size()
    pool = Pool(random.Random(seed * 31 + r))  # differs per rank: reuse pattern
    groups = [(None, list(range(w)))]
    if w >= 3:
        for ranks in ([0, 2], [1, 2], [0, 1]):
            groups.append((comm.new_group(ranks), ranks))
    bad = []

    async def one(i: int) -> None:
        rng = random.Random(seed * 100003 + i)  # same on every rank, whatever it skipped
        pool.reset()
        opname = rng.choice(
            [
                "all_reduce",
                "broadcast",
                "reduce",
                "all_gather",
                "agit",
                "rs_list",
                "rs_tensor",
                "a2a_single",
                "a2a_split",
                "a2a_list",
                "gather",
                "scatter",
                "ring",
                "batch",
                "sendrecv",
                "objects",
                "coalesced",
                "coalesced_mixed",
                "ag_coalesced",
                "p2p_many",
                "obj_p2p",
            ]
        )
        dt = rng.choice(DT)
        mode = rng.choice(["blocking", "wait", "await"])
        gobj, ranks = rng.choice(groups)
        gw = len(ranks)
        shape = rng.choice([(), (0,), (1,), (5,), (2, 3), (7,), (gw * 2,), (gw, 3)])
        if r not in ranks:
            return
        me = ranks.index(r)
        a = mode != "blocking"
        inputs = [gen(seed, i, ranks[k], shape, dt) for k in range(gw)]
        desc = f"op {i} {opname} {dt} shape {shape} mode {mode} group {ranks}"
        try:
            if opname in ("all_reduce", "reduce"):
                ops = ["sum", "max", "min", "product"]
                if dt is torch.complex64:
                    ops = ["sum", "product", "avg"]
                elif dt in FLOATS:
                    ops.append("avg")
                else:
                    ops += ["band", "bor", "bxor"]
                op = rng.choice(ops)
                spell = rng.choice([op, op.upper(), getattr(comm.ReduceOp, op.upper())])
                desc += f" op {op}"
                t = pool.get(shape, dt, inputs[me])
                dst = rng.randrange(gw)
                alg = rng.choice(["native", "native", "ring", "naive"])
                desc += f" alg {alg}"
                if opname == "all_reduce":
                    h = comm.all_reduce(t, spell, group=gobj, async_op=a, algorithm=alg)
                else:
                    h = comm.reduce(t, ranks[dst], spell, group=gobj, async_op=a)
                await finish(h, mode)
                if opname == "all_reduce" or me == dst:
                    exp = fold(op, inputs)
                    if not same(t, exp, tol=(op == "avg")):
                        bad.append(f"{desc}: got {t} want {exp}")
            elif opname == "broadcast":
                src = rng.randrange(gw)
                t = pool.get(shape, dt, inputs[me])
                h = comm.broadcast(t, ranks[src], group=gobj, async_op=a)
                await finish(h, mode)
                if not same(t, inputs[src]):
                    bad.append(f"{desc} src {src}: got {t} want {inputs[src]}")
            elif opname == "all_gather":
                t = pool.get(shape, dt, inputs[me])
                outs = [torch.empty(shape, dtype=dt) for _ in range(gw)]
                h = comm.all_gather(outs, t, group=gobj, async_op=a)
                await finish(h, mode)
                for k in range(gw):
                    if not same(outs[k], inputs[k]):
                        bad.append(f"{desc} [{k}]: got {outs[k]} want {inputs[k]}")
            elif opname == "agit":
                if len(shape) == 0:
                    shape = (1,)
                    inputs = [x.reshape(1) for x in inputs]
                t = pool.get(shape, dt, inputs[me])
                out = pool.get((gw * shape[0], *shape[1:]), dt)
                h = comm.all_gather_into_tensor(out, t, group=gobj, async_op=a)
                await finish(h, mode)
                exp = torch.cat(inputs)
                if not same(out, exp):
                    bad.append(f"{desc}: got {out} want {exp}")
            elif opname in ("rs_list", "rs_tensor"):
                op = rng.choice(["sum", "max", "min"])
                if dt is torch.complex64:
                    op = "sum"
                desc += f" op {op}"
                full = [gen(seed, i, ranks[k], (gw, *shape), dt, 5) for k in range(gw)]
                exp = fold(op, [f[me] for f in full])
                out = pool.get(shape, dt)
                if opname == "rs_list":
                    il = [full[me][k].clone() for k in range(gw)]
                    h = comm.reduce_scatter(out, il, op, group=gobj, async_op=a)
                else:
                    if len(shape) == 0:
                        return
                    inp = pool.get(
                        (gw * shape[0], *shape[1:]),
                        dt,
                        full[me].reshape((gw * shape[0], *shape[1:])),
                    )
                    h = comm.reduce_scatter_tensor(out, inp, op, group=gobj, async_op=a)
                await finish(h, mode)
                if not same(out, exp):
                    bad.append(f"{desc}: got {out} want {exp}")
            elif opname in ("a2a_single", "a2a_split"):
                if opname == "a2a_single":
                    per = rng.choice([0, 1, 3])
                    send_sizes = [[per] * gw for _ in range(gw)]
                else:
                    srng = random.Random(seed * 7 + i)
                    send_sizes = [[srng.randrange(0, 4) for _ in range(gw)] for _ in range(gw)]
                xs = [gen(seed, i, ranks[k], (sum(send_sizes[k]),), dt, 9) for k in range(gw)]
                insz = send_sizes[me]
                outsz = [send_sizes[k][me] for k in range(gw)]
                inp = pool.get((sum(insz),), dt, xs[me])
                out = pool.get((sum(outsz),), dt)
                if opname == "a2a_single":
                    h = comm.all_to_all_single(out, inp, group=gobj, async_op=a)
                else:
                    h = comm.all_to_all_single(out, inp, outsz, insz, group=gobj, async_op=a)
                await finish(h, mode)
                pieces = []
                for k in range(gw):
                    off = sum(send_sizes[k][:me])
                    pieces.append(xs[k][off : off + send_sizes[k][me]])
                exp = torch.cat(pieces) if pieces else torch.empty(0, dtype=dt)
                if not same(out, exp):
                    bad.append(f"{desc} sizes {send_sizes}: got {out} want {exp}")
            elif opname == "a2a_list":
                ins = [gen(seed, i, ranks[me], shape, dt, 100 + k) for k in range(gw)]
                outs = [torch.empty(shape, dtype=dt) for _ in range(gw)]
                h = comm.all_to_all(outs, ins, group=gobj, async_op=a)
                await finish(h, mode)
                for k in range(gw):
                    exp = gen(seed, i, ranks[k], shape, dt, 100 + me)
                    if not same(outs[k], exp):
                        bad.append(f"{desc} [{k}]: got {outs[k]} want {exp}")
            elif opname == "gather":
                dst = rng.randrange(gw)
                t = pool.get(shape, dt, inputs[me])
                gl = [torch.empty(shape, dtype=dt) for _ in range(gw)] if me == dst else None
                h = comm.gather(t, gl, ranks[dst], group=gobj, async_op=a)
                await finish(h, mode)
                if me == dst:
                    for k in range(gw):
                        if not same(gl[k], inputs[k]):
                            bad.append(f"{desc} [{k}]: got {gl[k]} want {inputs[k]}")
            elif opname == "scatter":
                src = rng.randrange(gw)
                sl = [gen(seed, i, ranks[src], shape, dt, 200 + k) for k in range(gw)]
                out = pool.get(shape, dt)
                h = comm.scatter(out, sl if me == src else None, ranks[src], group=gobj, async_op=a)
                await finish(h, mode)
                if not same(out, sl[me]):
                    bad.append(f"{desc}: got {out} want {sl[me]}")
            elif opname in ("ring", "batch", "sendrecv"):
                if gw < 2:
                    return
                tag = rng.choice([0, 0, 3, 77])
                anysrc = opname != "batch" and rng.random() < 0.3 and gw == 2
                nxt, prv = ranks[(me + 1) % gw], ranks[(me - 1) % gw]
                s = pool.get(shape, dt, inputs[me])
                # sendrecv in place (the send a copy) a quarter of the time
                rv = s if opname == "sendrecv" and rng.random() < 0.25 else pool.get(shape, dt)
                if opname == "sendrecv":
                    src = None if anysrc else prv
                    h = comm.sendrecv(s, nxt, rv, src, group=gobj, tag=tag, async_op=a)
                    await finish(h, mode)
                    if a and h.source != prv:
                        bad.append(f"{desc}: source {h.source} want {prv}")
                elif opname == "ring":
                    if a:
                        hs = [
                            comm.irecv(rv, None if anysrc else prv, group=gobj, tag=tag),
                            comm.isend(s, nxt, group=gobj, tag=tag),
                        ]
                        await finish(hs, mode)
                    else:
                        if me % 2 == 0:
                            comm.send(s, nxt, group=gobj, tag=tag)
                            comm.recv(rv, None if anysrc else prv, group=gobj, tag=tag)
                        else:
                            comm.recv(rv, None if anysrc else prv, group=gobj, tag=tag)
                            comm.send(s, nxt, group=gobj, tag=tag)
                else:
                    hs = comm.batch_isend_irecv(
                        [
                            comm.P2POp(comm.isend, s, nxt, gobj, tag),
                            comm.P2POp(comm.irecv, rv, prv, gobj, tag),
                        ]
                    )
                    await finish(hs, "wait" if mode == "blocking" else mode)
                exp = inputs[(me - 1) % gw]
                if not same(rv, exp):
                    bad.append(f"{desc} tag {tag} anysrc {anysrc}: got {rv} want {exp}")
            elif opname == "objects":
                kind = rng.choice(["bcast", "agather", "gather", "scatter"])
                desc += f" {kind}"
                objs = [{"r": ranks[k], "i": i, "t": inputs[k], "s": "x" * k} for k in range(gw)]
                src = rng.randrange(gw)
                if kind == "bcast":
                    lst = [objs[me], None] if me == src else [None, None]
                    comm.broadcast_object_list(lst, ranks[src], group=gobj)
                    got, exp = lst[0], objs[src]
                elif kind == "agather":
                    lst = [None] * gw
                    comm.all_gather_object(lst, objs[me], group=gobj)
                    got, exp = lst, objs
                elif kind == "gather":
                    lst = [None] * gw if me == src else None
                    comm.gather_object(objs[me], lst, ranks[src], group=gobj)
                    got, exp = (lst, objs) if me == src else (0, 0)
                else:
                    out = [None]
                    comm.scatter_object_list(
                        out, objs if me == src else None, ranks[src], group=gobj
                    )
                    got, exp = out[0], objs[me]
                if repr(got) != repr(exp):
                    bad.append(f"{desc}: got {got!r} want {exp!r}")
            elif opname == "coalesced":
                ts = [pool.get(shape, dt, inputs[me]), gen(seed, i, ranks[me], (3,), dt, 300)]
                exp = [
                    fold("sum", inputs),
                    fold("sum", [gen(seed, i, ranks[k], (3,), dt, 300) for k in range(gw)]),
                ]
                h = comm.all_reduce_coalesced(ts, "sum", group=gobj, async_op=a)
                await finish(h, mode)
                for k in range(2):
                    if not same(ts[k], exp[k]):
                        bad.append(f"{desc} [{k}]: got {ts[k]} want {exp[k]}")
            elif opname == "coalesced_mixed":
                op = rng.choice(["sum", "max", "min", "product"])
                dts = [rng.choice(DT[:-1]) for _ in range(rng.randrange(1, 5))]
                if op in ("max", "min"):
                    dts = [d for d in dts if d is not torch.complex64] or [torch.float32]
                shp = [rng.choice([(), (0,), (3,), (2, 2)]) for _ in dts]
                desc += f" op {op} dts {dts} shapes {shp}"
                ins = [
                    [
                        gen(seed, i, ranks[k], sh, d, 400 + j)
                        for j, (sh, d) in enumerate(zip(shp, dts, strict=True))
                    ]
                    for k in range(gw)
                ]
                ts = [
                    pool.get(sh, d, ins[me][j])
                    for j, (sh, d) in enumerate(zip(shp, dts, strict=True))
                ]
                h = comm.all_reduce_coalesced(ts, op, group=gobj, async_op=a)
                await finish(h, mode)
                for j in range(len(ts)):
                    exp = fold(op, [ins[k][j] for k in range(gw)])
                    if not same(ts[j], exp):
                        bad.append(f"{desc} [{j}]: got {ts[j]} want {exp}")
            elif opname == "ag_coalesced":
                dts = [rng.choice(DT) for _ in range(rng.randrange(1, 4))]
                ns = [rng.randrange(0, 4) for _ in dts]
                desc += f" dts {dts} ns {ns}"
                ins = [
                    [
                        gen(seed, i, ranks[k], (n,), d, 500 + j)
                        for j, (n, d) in enumerate(zip(ns, dts, strict=True))
                    ]
                    for k in range(gw)
                ]
                src_ts = [
                    pool.get((n,), d, ins[me][j])
                    for j, (n, d) in enumerate(zip(ns, dts, strict=True))
                ]
                outs = [pool.get((gw * n,), d) for n, d in zip(ns, dts, strict=True)]
                h = comm.all_gather_coalesced(outs, src_ts, group=gobj, async_op=a)
                await finish(h, mode)
                for j in range(len(outs)):
                    exp = torch.cat([ins[k][j] for k in range(gw)])
                    if not same(outs[j], exp):
                        bad.append(f"{desc} [{j}]: got {outs[j]} want {exp}")
            elif opname == "p2p_many":
                if gw < 2:
                    return
                m = rng.randrange(2, 6)
                tag = rng.choice([0, 5])
                nxt, prv = ranks[(me + 1) % gw], ranks[(me - 1) % gw]
                sends = [gen(seed, i, r, shape, dt, 600 + j) for j in range(m)]
                recvs = [torch.empty(shape, dtype=dt) for _ in range(m)]
                if a or me % 2 == 0:
                    hs = [comm.irecv(x, prv, group=gobj, tag=tag) for x in recvs]
                    hs += [comm.isend(x, nxt, group=gobj, tag=tag) for x in sends]
                    await finish(hs, "wait" if mode == "blocking" else mode)
                else:
                    hs = [comm.isend(x, nxt, group=gobj, tag=tag) for x in sends]
                    for x in recvs:
                        comm.recv(x, prv, group=gobj, tag=tag)
                    for x in hs:
                        x.wait()
                for j in range(m):
                    exp = gen(seed, i, prv, shape, dt, 600 + j)
                    if not same(recvs[j], exp):
                        bad.append(f"{desc} msg {j}/{m} tag {tag}: got {recvs[j]} want {exp}")
            elif opname == "obj_p2p":
                if gw < 2:
                    return
                nxt, prv = ranks[(me + 1) % gw], ranks[(me - 1) % gw]
                objs = [{"from": r, "i": i, "t": inputs[me]}, "s" * (i % 7)]
                anys = rng.random() < 0.5 and gw == 2
                out = [None, None]
                if me % 2 == 0:
                    comm.send_object_list(objs, nxt, group=gobj)
                    who = comm.recv_object_list(out, None if anys else prv, group=gobj)
                else:
                    who = comm.recv_object_list(out, None if anys else prv, group=gobj)
                    comm.send_object_list(objs, nxt, group=gobj)
                exp = [{"from": prv, "i": i, "t": inputs[(me - 1) % gw]}, "s" * (i % 7)]
                if repr(out) != repr(exp) or who != prv:
                    bad.append(f"{desc} anys {anys}: got {out!r} from {who} want {exp!r} {prv}")
        except Exception as e:
            bad.append(f"{desc}: raised {type(e).__name__}: {e}")

    async def main() -> None:
        for i in range(nops):
            await one(i)
        comm.barrier()

    try:
        overlap.run(main())
    finally:
        for g, ranks in groups[1:]:
            if r in ranks:  # every member frees it, none in flight
                comm.destroy_process_group(g)
    return bad
