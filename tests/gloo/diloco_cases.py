"""Rank-side checks of DiLoCo and the Int8/FP8 quantizers (gloo pools; some run under
mpiexec too).

The reference is DiLoCo computed from the math for all W ranks in one process: each rank's
inner AdamW on its own gradients; at a fragment's issue step the pseudo-gradients
(global - local) are averaged; at its landing step the global fragment takes a Nesterov SGD
step written out by hand (buf = m buf + d; global -= lr (d + m buf)) and the local fragment
becomes alpha local + (1 - alpha) global.
"""

from __future__ import annotations

import asyncio
import gc
import io
import logging
import math
import os
import threading
import time
from typing import Any

import torch
from torch import nn

import overlap
from overlap import BucketScheduler, DiLoCo, comm
from overlap.errors import CommError, NonFiniteError
from tests.gloo.catching import catcher, run_dropping

SHAPES = [(5, 3), (7,), (4, 4), (1,), (33,)]
LR_IN = 0.05
LR_OUT, MOM = 0.7, 0.9


class Params(nn.Module):
    """``strided``: the same values, every 2-D parameter stored transposed (not contiguous,
    as a channels_last convolution's weight is). ``frozen``: a frozen parameter
    (``requires_grad=False``, ones) besides ``ps``, which the optimizers built over
    ``model.parameters()`` hold too."""

    def __init__(self, seed: int = 0, strided: bool = False, frozen: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        ts = [torch.randn(s, generator=g) for s in SHAPES]
        if strided:
            ts = [t.t().contiguous().t() if t.dim() == 2 else t for t in ts]
        self.ps = nn.ParameterList(nn.Parameter(t) for t in ts)
        if frozen:
            self.still = nn.Parameter(torch.ones(3), requires_grad=False)


def _grads(params: list[torch.Tensor], rank: int, t: int) -> list[torch.Tensor]:
    """A per-rank quadratic pull towards a moving target: grad = p - target(rank, t)."""
    g = torch.Generator().manual_seed(1000 * rank + t)
    return [p.detach() - torch.randn(p.shape, generator=g) for p in params]


class Reference:
    """DiLoCo / Streaming DiLoCo for W simulated ranks, from the math. ``grads``: simulated
    rank r's gradients at step t (:func:`_grads` by default)."""

    def __init__(
        self,
        w: int,
        h: int,
        frags: list[list[int]],
        delay: int,
        alpha: float,
        offs: list[int],
        grads: Any = None,
    ) -> None:
        self.w, self.h, self.frags, self.delay, self.alpha, self.offs = (
            w,
            h,
            frags,
            delay,
            alpha,
            offs,
        )
        self.grads = grads or _grads
        base = [p.detach().clone() for p in Params().ps]
        self.local = [[nn.Parameter(b.clone()) for b in base] for _ in range(w)]
        self.inner = [torch.optim.AdamW(ps, lr=LR_IN) for ps in self.local]
        self.glob = [b.clone() for b in base]
        self.buf = [torch.zeros_like(b) for b in base]
        self.pending: dict[int, tuple[int, list[torch.Tensor]]] = {}
        self.t = 0

    def step(self) -> None:
        self.t += 1
        for r in range(self.w):
            for p, g in zip(self.local[r], self.grads(list(self.local[r]), r, self.t), strict=True):
                p.grad = g
            self.inner[r].step()
        for i in sorted(i for i, (at, _) in self.pending.items() if at == self.t):
            self._land(i)
        for i, off in enumerate(self.offs):
            if self.t % self.h == off:
                self.pending[i] = (self.t + self.delay, self._pseudo(i))
                if self.delay == 0:
                    self._land(i)

    def _land(self, i: int, alpha: float | None = None) -> None:
        a = self.alpha if alpha is None else alpha
        _, d = self.pending.pop(i)
        for j, dj in zip(self.frags[i], d, strict=True):
            self.buf[j] = MOM * self.buf[j] + dj
            self.glob[j] = self.glob[j] - LR_OUT * (dj + MOM * self.buf[j])
            for r in range(self.w):
                with torch.no_grad():
                    p = self.local[r][j]
                    p.copy_(a * p + (1 - a) * self.glob[j])

    def _pseudo(self, i: int) -> list[torch.Tensor]:
        return [
            sum(self.glob[j] - self.local[r][j].detach() for r in range(self.w)) / self.w
            for j in self.frags[i]
        ]

    def finish(self) -> list[int]:
        """DiLoCo.finish() from the math: land what is pending, then sync every fragment
        that some rank holds apart from the global weights, landing it with no merge;
        returns those fragments."""
        for i in sorted(self.pending):
            self._land(i)
        due = [
            i
            for i, frag in enumerate(self.frags)
            if any(
                not torch.equal(self.local[r][j].detach(), self.glob[j])
                for r in range(self.w)
                for j in frag
            )
        ]
        for i in due:
            self.pending[i] = (self.t, self._pseudo(i))
        for i in due:
            self._land(i, alpha=0.0)
        return due


def _build(
    h: int, frags: int = 1, delay: int = 0, strided: bool = False, frozen: bool = False, **kw: Any
) -> tuple[Params, Any, DiLoCo]:
    model = Params(strided=strided, frozen=frozen)
    inner = torch.optim.AdamW(model.parameters(), lr=LR_IN)
    outer = torch.optim.SGD(model.parameters(), lr=LR_OUT, momentum=MOM, nesterov=True)
    d = DiLoCo(model, inner, outer, sync_every=h, fragments=frags, delay=delay, **kw)
    return model, inner, d


def workers_of_several_ranks(h: int = 3, steps: int = 8) -> dict[str, Any]:
    """Hierarchical DiLoCo on 4 ranks, 2 workers of 2: a BucketScheduler averages each
    worker's gradients (ranks [0, 1] and [2, 3]) and a DiLoCo syncs one rank per worker
    ([0, 2] and [1, 3]), the ranks seeded apart. Against the 2-rank reference whose worker
    w takes the mean of its two ranks' gradients, step by step; then the refusals around
    it, after finish() (which makes the buffers agree over all 4 ranks). Returns what was
    refused, and the buffers after finish()."""
    from overlap.topology import ProcessTopology

    r = comm.get_rank()
    topo = ProcessTopology(["worker", "local"], [2, 2])
    groups = {}
    for axis in ("local", "worker"):  # every rank makes every group, in one order
        for ranks in topo.get_axis_comm_lists(axis):
            g = comm.new_group(ranks)
            if r in ranks:
                groups[axis] = g
    model = Params(seed=r)
    model.register_buffer("stat", torch.zeros(3))  # a running statistic, say
    model.register_buffer("count", torch.zeros((), dtype=torch.int64))
    sched = BucketScheduler(model, group=groups["local"])
    inner = torch.optim.AdamW(model.parameters(), lr=LR_IN)
    outer = torch.optim.SGD(model.parameters(), lr=LR_OUT, momentum=MOM, nesterov=True)
    d = DiLoCo(model, inner, outer, sync_every=h, group=groups["worker"])

    def worker_grads(ps: list[torch.Tensor], w: int, t: int) -> list[torch.Tensor]:
        pairs = zip(_grads(ps, 2 * w, t), _grads(ps, 2 * w + 1, t), strict=True)
        return [(a + b) / 2 for a, b in pairs]

    ref = Reference(2, h, d.frags, 0, d.alpha, d.offsets, worker_grads)
    for t in range(1, steps + 1):
        ps = list(model.ps)
        g = torch.Generator().manual_seed(1000 * r + t)  # _grads' targets, through backward
        loss = sum(0.5 * (p - torch.randn(p.shape, generator=g)).square().sum() for p in ps)
        loss.backward()
        sched.synchronize()
        inner.step()
        inner.zero_grad()
        d.step()
        ref.step()
        _close(list(model.ps), [p.detach() for p in ref.local[r // 2]], f"step {t} local")
        _close(d.globals, ref.glob, f"step {t} global")
    out: dict[str, Any] = {"syncs": d.syncs}
    # each rank's own statistics; finish() averages them over all 4 ranks (across the
    # workers, then inside each), and every rank takes global rank 0's counter
    model.stat.fill_(float(r))
    model.count.fill_(10 + r)
    d.finish()
    out["finished_buffers"] = [model.stat.tolist(), int(model.count)]
    catch = catcher(out)
    catch("scheduler_on_top", lambda: BucketScheduler(model, group=groups["local"]))
    d.remove()  # the scheduler holds the parameters again
    catch("second_scheduler", lambda: BucketScheduler(model, group=groups["local"]))
    inner2 = torch.optim.AdamW(model.parameters(), lr=LR_IN)
    # the DiLoCo over the scheduler's own ranks: every rank refuses
    catch("same_ranks", lambda: DiLoCo(model, inner2, group=groups["local"]))
    sched.remove()
    DiLoCo(model, inner2, group=groups["worker"]).remove()  # nothing holds them now
    return out


def _inner_step(model: Params, inner: Any, t: int) -> None:
    ps = list(model.ps)
    for p, g in zip(ps, _grads(ps, comm.get_rank(), t), strict=True):
        p.grad = g
    inner.step()
    inner.zero_grad()


def _close(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for k, (a, b) in enumerate(zip(got, want, strict=True)):
        if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
            raise AssertionError(f"{what}: tensor {k} differs by {(a - b).abs().max():.3g}")


def matches_reference(
    hs: list[int],
    frags: int = 1,
    delay: int = 0,
    mode: str = "blocking",
    steps: int = 20,
    alpha: float = 0.0,
    group: Any = None,
    landing: str = "fused",
    strided: bool = False,
    frozen: bool = False,
    slow_pass: float = 0.0,
    background: bool | None = None,
) -> list[Any]:
    """Run DiLoCo against the reference for each H (``group``'s ranks are the simulated
    ranks 0..W-1, so it must hold the lowest global ranks); return, per H, the fragments,
    their offsets and the syncs issued. ``landing``: "fused" checks that the landings run
    the fused kernel; "torch" puts an LR scheduler on the outer optimizer (it patches
    ``step``), so they run ``outer.step()`` itself. ``strided``: the model's 2-D parameters
    are not contiguous (:class:`Params`), so the fragment holding them (fragment 0) lands
    through ``outer.step()`` and any other fused, against the contiguous reference.
    ``frozen``: the model has a frozen parameter, in both optimizers (the usual
    ``model.parameters()``): DiLoCo skips it, and after the run refuses it unfrozen (what
    :meth:`DiLoCo.step` raised is appended, with whether it stayed ones). ``slow_pass``:
    each streaming pseudo-gradient pass first sleeps this long on its thread, so the inner
    optimizer's next step comes while it would still read the weights (the step must wait
    for it; the number of passes taken off the training thread is appended).
    ``background``: DiLoCo's ``background=``; when True, the CPU priority (nice) each
    reduction ran at is appended (one value for all, or the list of them)."""
    w, r = comm.get_world_size(group), comm.get_rank()
    out: list[Any] = []
    for h in hs:
        model, inner, d = _build(
            h, frags, delay, strided, frozen, alpha=alpha, group=group,
            pass_thread=True if slow_pass else None, background=background,
        )  # fmt: skip
        nices: list[int] = []
        if background:
            steps_of = d.compression.reduce_steps

            def niced(*a: Any, steps_of: Any = steps_of, nices: list[int] = nices, **k: Any) -> Any:
                nices.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
                return (yield from steps_of(*a, **k))

            d.compression.reduce_steps = niced  # type: ignore[method-assign]
        if strided and any(p.is_contiguous() for p in model.ps if p.dim() == 2):
            raise AssertionError("the strided model's 2-D parameters are contiguous")
        if landing == "torch":
            torch.optim.lr_scheduler.LambdaLR(d.outer, lambda epoch: 1.0)
        fused = d._kernels is not None and d._fusable(0, torch.zeros(1))
        if fused != (landing == "fused" and not strided):
            raise AssertionError(f"wanted the {landing} landing, fused={fused}")
        ref = Reference(w, h, d.frags, delay, d.alpha, d.offsets)
        passes = [0]
        if slow_pass:
            take = d._pass

            def slowly(*a: Any, take: Any = take, passes: list[int] = passes) -> list[int]:
                time.sleep(slow_pass)
                passes[0] += 1
                return take(*a)

            d._pass = slowly  # type: ignore[method-assign]
        try:
            for t in range(1, steps + 1):
                _inner_step(model, inner, t)
                if mode == "async":
                    overlap.run(d.astep())
                else:
                    d.step()
                ref.step()
                _close(list(model.ps), [p.detach() for p in ref.local[r]], f"H={h} step {t} local")
                _close(d.globals, ref.glob, f"H={h} step {t} global")
            out.append([d.frags, d.offsets, d.statistics()["syncs"]])
            if slow_pass:
                out[-1].append(passes[0])
            if background:
                out[-1].append(sorted(set(nices)) if len(set(nices)) > 1 else nices[0])
            if frozen:
                out[-1].append(bool(torch.equal(model.still, torch.ones(3))))
                model.still.requires_grad_(True)
                caught: dict[str, str] = {}
                catcher(caught)("unfrozen", d.step)
                out[-1].append(caught["unfrozen"])
        finally:
            d.remove()
    return out


def finish_ends_on_one_model(
    h: int,
    frags: int,
    delay: int,
    steps: int,
    alpha: float,
    landing: str = "fused",
    mode: str = "blocking",
    group: Any = None,
) -> list[Any]:
    """``finish()`` after ``steps`` steps against the reference's (land what is in flight;
    sync each fragment some rank holds apart; no merge), then H more steps against it.
    ``landing``: "torch" makes the landings run ``outer.step()`` (see matches_reference).
    ``mode`` "async": ``await astep()`` and ``await afinish()`` in an event loop.
    ``group``: DiLoCo on that group (its ranks the lowest global ones, as the reference's).
    Returns [fragments it synced (from the syncs counted), every rank the same bits,
    weights == globals, syncs a second finish() added]."""
    w, r = comm.get_world_size(group), comm.get_rank()
    model, inner, d = _build(h, frags, delay, alpha=alpha, group=group)
    if landing == "torch":
        torch.optim.lr_scheduler.LambdaLR(d.outer, lambda epoch: 1.0)
    ref = Reference(w, h, d.frags, delay, d.alpha, d.offsets)

    def step() -> None:
        d.step() if mode == "blocking" else overlap.run(d.astep())

    def finish() -> None:
        d.finish() if mode == "blocking" else overlap.run(d.afinish())

    try:
        for t in range(1, steps + 1):
            _inner_step(model, inner, t)
            step()
            ref.step()
        before = d.statistics()["syncs"]
        finish()
        due = ref.finish()
        _close(list(model.ps), [p.detach() for p in ref.local[r]], "finished local")
        _close(d.globals, ref.glob, "finished global")
        synced = d.statistics()["syncs"] - before
        if synced != len(due):
            raise AssertionError(f"finish() synced {synced} fragments, the math {due}")
        flat = torch.cat([p.detach().reshape(-1) for p in model.ps])
        every = [torch.empty_like(flat) for _ in range(w)]
        comm.all_gather(every, flat, group=group)
        same = all(torch.equal(x, flat) for x in every)
        on_globals = all(torch.equal(p, g) for p, g in zip(model.ps, d.globals, strict=True))
        finish()
        again = d.statistics()["syncs"] - before - synced
        for t in range(steps + 1, steps + h + 1):  # training goes on, on the same schedule
            _inner_step(model, inner, t)
            step()
            ref.step()
        _close(list(model.ps), [p.detach() for p in ref.local[r]], "after finish, local")
        _close(d.globals, ref.glob, "after finish, global")
        return [due, same, on_globals, again]
    finally:
        d.remove()


def finish_with_int8() -> list[Any]:
    """Streaming DiLoCo with Int8 pseudo-gradients: finish() ends every rank on the same
    bits, the global weights. Returns [in flight before, every rank the same, == globals]."""
    w = comm.get_world_size()
    model, inner, d = _build(4, 2, 1, compression=overlap.Int8(block=8))
    try:
        for t in range(1, 11):  # fragment 0 issued at 10, in flight
            _inner_step(model, inner, t)
            d.step()
        in_flight = d.statistics()["in_flight"]
        d.finish()
        flat = torch.cat([p.detach().reshape(-1) for p in model.ps])
        every = [torch.empty_like(flat) for _ in range(w)]
        comm.all_gather(every, flat)
        same = all(torch.equal(x, flat) for x in every)
        on_globals = all(torch.equal(p, g) for p, g in zip(model.ps, d.globals, strict=True))
        return [in_flight, same, on_globals]
    finally:
        d.remove()


def traced_syncs(delay: int, mode: str, path: str) -> dict[str, Any]:
    """A DiLoCo given a Tracer (H=4, 2 fragments, 8 steps, then flush) records each
    fragment's issue, its reduction (a ``bucket`` span from the post to its completion),
    the wait at its landing, the landing and a step mark per step; the report and the
    Chrome export read them. Returns what was recorded."""
    import json

    tracer = overlap.Tracer()
    model, inner, d = _build(4, 2, delay, tracer=tracer, pass_thread=True)
    try:
        for t in range(1, 9):
            _inner_step(model, inner, t)
            if mode == "blocking":
                d.step()
            else:
                overlap.run(d.astep())
        d.flush()
        wait_s = d.statistics()["wait_s"]
    finally:
        d.remove()
        tracer.detach()
    spans = list(tracer.spans)

    def named(prefix: str) -> list[Any]:
        return [s for s in spans if s[0].startswith(prefix)]

    import threading

    me = threading.get_ident()
    took = named("diloco pseudo-gradient")
    reduce = sorted((s for s in spans if s[1] == "bucket"), key=lambda s: s[2])
    waits = sorted((s for s in spans if s[1] == "wait"), key=lambda s: s[2])
    # the k-th reduction of a fragment starts after its issue began and ends before the
    # k-th wait for that fragment does (the wait returns once the reduction has completed)
    ordered = all(
        r[5]["ready_ns"] <= r[2] <= r[3] <= w[3]
        for f in (0, 1)
        for r, w in zip(
            [r for r in reduce if r[5]["bucket"] == f],
            [w for w in waits if w[5]["fragment"] == f],
            strict=True,
        )
    )
    report = tracer.report()
    exported = tracer.export_chrome(path)  # a collective: rank 0 writes every rank's
    events: list[dict[str, Any]] = []
    if exported is not None:
        with open(exported) as f:
            events = json.load(f)["traceEvents"]
    return {
        "issue": len(named("diloco issue")),
        # a streaming sync's pseudo-gradient is taken on the pass thread
        "took": (len(took), all(s[4] != me for s in took)),
        "reduce": [(r[5]["bucket"], r[5]["step"], r[5]["lands"]) for r in reduce],
        "wait": len([s for s in spans if s[1] == "wait"]),
        "land": len(named("diloco land")),
        "steps": len([s for s in spans if s[1] == "step"]),
        "comm": any(s[1] == "comm" for s in spans),
        "ordered": ordered,
        # statistics()["wait_s"] counts what the wait spans show (each end read apart)
        "wait_s": wait_s > 0
        and abs(wait_s - sum(w[3] - w[2] for w in waits) / 1e9) < 1e-3 * len(waits),
        "report_buckets": sorted(b["bucket"] for b in report.buckets),
        # rank 0's file holds both ranks' syncs; the other rank writes nothing
        "exported": len([e for e in events if e.get("name") == "reduce fragment 0"]) >= 4
        if comm.get_rank() == 0
        else exported is None,
    }


def write_during_a_pass_is_refused() -> list[Any]:
    """A weight written in place after step() issued its fragment and before its pass read
    it (the pass thread held up meanwhile): the inner optimizer's next step raises, naming
    the parameter, and the step is not taken. Returns the error, whether the weights stayed
    as the write left them, and whether the pass waited at the step."""
    import threading

    model, inner, d = _build(4, 2, 1, pass_thread=True)  # fragment 0 issues at 2, 6; 1 at 4
    caught: dict[str, str] = {}
    try:
        for t in range(1, 4):
            _inner_step(model, inner, t)
            d.step()
        assert d._passes is not None, "step 2's pass was not taken off the training thread"
        hold = threading.Event()
        d._passes.submit(hold.wait)
        _inner_step(model, inner, 4)
        d.step()  # issues fragment 1: its pass waits behind `hold`
        j = d.frags[1][0]
        with torch.no_grad():
            model.ps[j].add_(1.0)
        after = [p.detach().clone() for p in model.ps]
        threading.Timer(0.1, hold.set).start()
        ps = list(model.ps)
        for p, g in zip(ps, _grads(ps, comm.get_rank(), 5), strict=True):
            p.grad = g
        catcher(caught)("write", inner.step)
        unchanged = all(torch.equal(a, p) for a, p in zip(after, model.ps, strict=True))
        waited = d.statistics()["pass_wait_s"] >= 0.05
    finally:
        d.remove()
    return [caught.get("write", ""), unchanged, waited]


def on_a_subgroup() -> Any:
    """3 ranks; ranks 0 and 1 run DiLoCo on their own group (a data-parallel group), with a
    delay, while rank 2 stays out: it equals the 2-rank reference, and so does finish()."""
    g = comm.new_group([0, 1])  # every rank makes it
    if comm.get_rank() == 2:
        return None
    try:
        # and finish() on the group: its vote and syncs go to the group's ranks only
        finished = finish_ends_on_one_model(4, 2, 1, 10, 0.0, group=g)
        return [matches_reference([4], 2, 1, steps=12, group=g), finished]
    finally:
        comm.destroy_process_group(g)


def astep_returns_while_in_flight() -> list[Any]:
    """With a delay, astep() returns with the reduction still in flight; it lands later."""
    model, inner, d = _build(4, 2, 1)
    seen = []
    try:

        async def main() -> None:
            for t in range(1, 9):
                _inner_step(model, inner, t)
                await d.astep()
                seen.append(d.statistics()["in_flight"])

        overlap.run(main())
    finally:
        d.remove()
    return seen


def global_weights_swap() -> list[Any]:
    """``with d.global_weights():`` puts the global weights (equal on every rank) in the
    model and refuses a step; on exit the local weights are back bit for bit and training
    goes on; refused while an astep() waits for a landing. Returns [that refusal, fragments
    in flight, inside == globals, inside the same on every rank, locals differed from
    globals, the refusal names the block, back == locals, steps]."""
    model, inner, d = _build(4, 2, 1)
    try:
        for t in range(1, 9):  # fragment 0 landed at 7; fragment 1, issued at 8, in flight
            _inner_step(model, inner, t)
            d.step()
        in_flight = d.statistics()["in_flight"]
        local = [p.detach().clone() for p in model.ps]
        glob = [g.clone() for g in d.globals]
        drifted = any(not torch.equal(a, g) for a, g in zip(local, d.globals, strict=True))
        with d.global_weights():
            inside = [p.detach().clone() for p in model.ps]
            try:
                d.step()
                refused = ""
            except RuntimeError as exc:
                refused = str(exc)
        flat = torch.cat([t.reshape(-1) for t in inside])
        every = [torch.empty_like(flat) for _ in range(comm.get_world_size())]
        comm.all_gather(every, flat)
        same = all(torch.equal(x, flat) for x in every)
        back = all(torch.equal(p, x) for p, x in zip(model.ps, local, strict=True))
        # step 9 lands fragment 1 through astep(), held at its landing by a gate: meanwhile
        # another task's global_weights() is refused (the landing would be undone on exit)
        _inner_step(model, inner, 9)
        gate: list[Any] = []
        landing = d._await

        async def held(i: int) -> torch.Tensor:
            await gate[0].wait()
            return await landing(i)

        async def main() -> str:
            gate.append(asyncio.Event())
            d._await = held  # type: ignore[method-assign]
            task = asyncio.create_task(d.astep())
            await asyncio.sleep(0)
            try:
                with d.global_weights():
                    why = ""
            except RuntimeError as exc:
                why = str(exc)
            gate[0].set()
            await task
            return why

        try:
            while_landing = overlap.run(main())
        finally:
            del d._await
        _inner_step(model, inner, 10)
        d.step()
        return [
            "astep()" in while_landing,
            in_flight,
            all(torch.equal(a, g) for a, g in zip(inside, glob, strict=True)),
            same,
            drifted,
            "global_weights()" in refused,
            back,
            d.inner_steps,
        ]
    finally:
        d.remove()


def syncs_allocate_nothing_new() -> list[Any]:
    """Every buffer the syncs keep exists (and was touched) when DiLoCo is built: after
    three rounds of syncs the kept buffers are the same tensors, none added. Returns the
    number of kept buffers per fragment and whether the momentum came from the spares."""
    model, inner, d = _build(4, 2, 1, compression=overlap.Int8(block=8))
    try:
        comp = d.compression
        before = {k: {n: t.data_ptr() for n, t in b.items()} for k, b in comp._bufs.items()}
        pseudo = {i: t.data_ptr() for i, t in d._pseudo.items()}
        spares = {id(p): t.data_ptr() for p, t in zip(d.params, d._spare.values(), strict=True)}
        for t in range(1, 13):
            _inner_step(model, inner, t)
            d.step()
        after = {k: {n: t.data_ptr() for n, t in b.items()} for k, b in comp._bufs.items()}
        if after != before or {i: t.data_ptr() for i, t in d._pseudo.items()} != pseudo:
            raise AssertionError(f"buffers changed: {before} -> {after}")
        moms = {id(p): d.outer.state[p]["momentum_buffer"].data_ptr() for p in d.params}
        return [sorted(len(b) for b in before.values()), moms == spares, len(d._spare)]
    finally:
        d.remove()


def resume_is_bit_identical(compression: str) -> bool:
    """Streaming with a fragment in flight at the checkpoint: the resumed run equals the
    uninterrupted one bit for bit (model, inner optimizer and DiLoCo state saved)."""

    def make() -> tuple[Params, Any, DiLoCo]:
        comp = {"none": None, "int8": overlap.Int8(block=8)}[compression]
        return _build(4, 2, 1, compression=comp)

    model, inner, d = make()
    saved: bytes = b""
    try:
        for t in range(1, 15):
            if t == 7:  # fragment 0 issues at 2, 6, 10 and lands a step later: in flight
                buf = io.BytesIO()
                torch.save(
                    {"model": model.state_dict(), "inner": inner.state_dict(), "d": d.state_dict()},
                    buf,
                )
                saved = buf.getvalue()
                mid = d.statistics()["in_flight"]
            _inner_step(model, inner, t)
            d.step()
        want = [p.detach().clone() for p in model.ps] + [g.clone() for g in d.globals]
    finally:
        d.remove()
    model, inner, d = make()
    try:
        ck = torch.load(io.BytesIO(saved), weights_only=False)
        model.load_state_dict(ck["model"])
        inner.load_state_dict(ck["inner"])
        d.load_state_dict(ck["d"])
        for t in range(7, 15):
            _inner_step(model, inner, t)
            d.step()
        got = [p.detach().clone() for p in model.ps] + [g.clone() for g in d.globals]
    finally:
        d.remove()
    assert mid == [0], mid  # the checkpoint really held a fragment in flight
    return all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def quantized_reduce(kind: str, n: int, block: int) -> list[float]:
    """Int8/FP8 averages: one call's error within the code's resolution, and with error
    feedback the running sum of outputs tracks the running sum of exact averages."""
    w, r = comm.get_world_size(), comm.get_rank()
    comp = {"int8": overlap.Int8, "fp8": overlap.FP8}[kind](block=block)
    total_out = torch.zeros(n)
    total_true = torch.zeros(n)
    worst = 0.0
    for k in range(30):
        xs = [torch.randn(n, generator=torch.Generator().manual_seed(97 * k + j)) for j in range(w)]
        exact = torch.stack(xs).mean(0)
        got = comp.reduce("k", xs[r].clone(), async_op=(k % 2 == 1))
        got = got.wait() if k % 2 == 1 else got
        if k == 0:
            worst = float((got - exact).abs().max() / exact.abs().max())
        total_out += got
        total_true += exact
    drift = float((total_out - total_true).abs().max())
    same = comm.all_gather(total_out)
    assert all(torch.equal(s, same[0]) for s in same), "ranks disagree"
    return [worst, drift]


def quantized_in_scheduler(kind: str) -> list[float]:
    """A BucketScheduler with compression=Int8()/FP8() over several buckets (whose stages
    interleave on the worker thread): [the first step's worst error against the exact
    average, relative (no error feedback yet); the error of the mean over 6 steps of the same
    gradients, relative (error feedback makes it shrink)]."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    ref = [p.detach().clone() for p in model.parameters()]
    comp = {"int8": overlap.Int8, "fp8": overlap.FP8}[kind](block=64)
    sched = BucketScheduler(model, compression=comp, bucket_cap_mb=0.004, first_bucket_mb=0.004)
    steps = 6
    try:
        assert len(sched.buckets) >= 2, sched.buckets
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(comm.get_rank()))
        total = [torch.zeros_like(p) for p in ref]
        for k in range(steps):
            model.zero_grad()
            model(x).pow(2).sum().backward()
            sched.synchronize()
            if k == 0:
                got = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
            for t, p in zip(total, model.parameters(), strict=True):
                t += p.grad  # type: ignore[operator]
    finally:
        sched.remove()
    # the exact average, computed locally from every rank's input
    w = comm.get_world_size()
    exact = [torch.zeros_like(p) for p in ref]
    for j in range(w):
        m = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
        with torch.no_grad():
            for p, q in zip(m.parameters(), ref, strict=True):
                p.copy_(q)
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(j))
        m(x).pow(2).sum().backward()
        for e, p in zip(exact, m.parameters(), strict=True):
            e += p.grad / w  # type: ignore[operator]
    first = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, exact, strict=True))
    mean = max(
        float((t / steps - b).abs().max() / b.abs().max())
        for t, b in zip(total, exact, strict=True)
    )
    return [first, mean]


def nonfinite_leaves_globals(compression: str = "none") -> list[Any]:
    """A NaN on one rank: NonFiniteError on every rank, global weights unchanged (Int8: the
    codes never reach the landing). A compressor built with on_nonfinite="skip" raises
    nothing itself but gives NaN on every rank, which DiLoCo's landing refuses alike (it
    used to give each rank its own finite pseudo-gradient back: OneBit's rank 0 then
    landed its own, and the ranks' global weights parted)."""
    make = {
        "none": lambda: None,
        "int8": lambda: overlap.Int8(block=8),
        "int8-skip": lambda: overlap.Int8(block=8, on_nonfinite="skip"),
        "onebit-skip": lambda: overlap.OneBit(on_nonfinite="skip"),
    }[compression]
    model, inner, d = _build(2, compression=make())
    try:
        _inner_step(model, inner, 1)
        d.step()
        before = [g.clone() for g in d.globals]
        _inner_step(model, inner, 2)
        if comm.get_rank() == 1:
            with torch.no_grad():
                model.ps[0][0, 0] = math.nan
        try:
            d.step()
            return ["no error"]
        except NonFiniteError:
            pass
        flat = torch.cat([g.reshape(-1) for g in d.globals])
        return [
            "NonFiniteError",
            all(torch.equal(a, b) for a, b in zip(before, d.globals, strict=True)),
            all(torch.equal(flat, g) for g in comm.all_gather(flat)),
        ]
    finally:
        d.remove()


def refusals() -> dict[str, str]:
    """Every refusal with its message; nothing is held after one."""
    out: dict[str, str] = {}
    catch = catcher(out)
    model = Params()
    inner = torch.optim.AdamW(model.parameters())
    stray = [nn.Parameter(torch.ones(2))]
    catch("sync_every", lambda: DiLoCo(model, inner, sync_every=0))
    catch("delay", lambda: DiLoCo(model, inner, sync_every=4, delay=4))
    catch("fragments", lambda: DiLoCo(model, inner, sync_every=4, fragments=6))
    catch("outer_other", lambda: DiLoCo(model, inner, torch.optim.SGD(stray, lr=0.1)))
    part = list(model.parameters())[:2]
    catch("outer_part", lambda: DiLoCo(model, inner, torch.optim.SGD(part, lr=0.1)))
    catch("inner_other", lambda: DiLoCo(model, torch.optim.SGD(stray, lr=0.1)))
    catch("alpha", lambda: DiLoCo(model, inner, sync_every=4, delay=1, alpha=1.0))
    catch("auto", lambda: DiLoCo(model, inner, compression=overlap.Auto()))
    catch("string", lambda: DiLoCo(model, inner, compression="int8"))  # type: ignore[arg-type]
    catch("tracer", lambda: DiLoCo(model, inner, tracer="trace.json"))
    catch("pass_thread", lambda: DiLoCo(model, inner, pass_thread=1))  # type: ignore[arg-type]
    lazy = nn.Sequential(nn.LazyLinear(2))
    catch("lazy", lambda: DiLoCo(lazy, torch.optim.SGD(lazy.parameters(), lr=0.1)))
    sched = BucketScheduler(model)
    catch("after_scheduler", lambda: DiLoCo(model, inner))
    sched.remove()
    d = DiLoCo(model, inner)
    catch("scheduler_after", lambda: BucketScheduler(model))
    m2 = Params()
    other = DiLoCo(m2, torch.optim.AdamW(m2.parameters()), sync_every=8)
    catch("load_other", lambda: d.load_state_dict(other.state_dict()))
    other.remove()
    # the same model, an outer optimizer of two groups: refused before anything changes
    ps = list(m2.parameters())
    outer2 = torch.optim.SGD([{"params": ps[:2]}, {"params": ps[2:]}], lr=0.7, momentum=0.9)
    other = DiLoCo(m2, torch.optim.AdamW(ps), outer2)
    with torch.no_grad():
        for g in other.globals:
            g.add_(1.0)
    before = [g.clone() for g in d.globals]
    catch("load_outer_groups", lambda: d.load_state_dict(other.state_dict()))
    assert all(torch.equal(a, b) for a, b in zip(before, d.globals, strict=True))
    # states of two saves, one a rank (as a save interrupted on one rank leaves them), and a
    # state refused on rank 1 only: every rank refuses, nothing loaded (before: each rank
    # loaded its own, and they synced at other steps of their schedules, with no error)
    early = d.state_dict()
    for _ in range(3):
        d.step()
    late = d.state_dict()
    one = comm.get_rank() == 1
    catch("load_mixed_steps", lambda: d.load_state_dict(late if one else early))
    bad = {**late, "sync_every": 8} if one else late
    catch("load_refused_on_one", lambda: d.load_state_dict(bad))
    out["steps_after_refusals"] = str(d.statistics()["inner_steps"])
    d.load_state_dict(early)  # the same save on every rank: taken
    out["steps_after_load"] = str(d.statistics()["inner_steps"])
    other.remove()
    with d.global_weights():
        catch("finish_inside", d.finish)
    d.remove()
    catch("removed", d.step)
    catch("finish_removed", d.finish)
    DiLoCo(model, inner).remove()  # the model is free again after remove()
    # a rank with another schedule: every rank refuses, naming the odd one
    catch("differs", lambda: DiLoCo(model, inner, sync_every=4 + comm.get_rank()))
    # other settings: before, Int8 against none hung, and another outer learning rate
    # moved each rank's global weights apart with no error
    one = comm.get_rank() == 1
    catch(
        "other_compression",
        lambda: DiLoCo(model, inner, compression=overlap.Int8() if one else None),
    )
    lr = 0.5 if one else 0.7
    outer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True)
    catch("other_outer", lambda: DiLoCo(model, inner, outer_optimizer=outer))
    # remove() (and every refusal) left no step pre-hook on the inner optimizer
    out["hooks"] = str(len(inner._optimizer_step_pre_hooks))
    return out


def peer_dies_during_sync(timeout: float, call: str = "step") -> list[Any]:
    """Rank 1 is SIGKILLed while rank 0 waits on an outer sync (``call`` "step": step 2's;
    "finish": finish()'s, from its vote on): rank 0 gets CommError within the timeout
    (+ 5 s), with the global weights untouched."""
    import os
    import signal
    import threading

    model, inner, d = _build(2, compression=overlap.Int8(block=8))
    _inner_step(model, inner, 1)
    d.step()
    before = [g.clone() for g in d.globals]
    _inner_step(model, inner, 2)
    if comm.get_rank() == 1:
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        time.sleep(60)
    t0 = time.monotonic()
    try:
        if call == "step":
            d.step()
        else:
            d.finish()
    except CommError as e:
        return [
            "CommError",
            time.monotonic() - t0,
            type(e.__cause__).__name__,
            all(torch.equal(a, b) for a, b in zip(before, d.globals, strict=True)),
            d.statistics()["in_flight"],
        ]
    finally:
        d.remove()
    return ["no error"]


def int8_lands_from_its_codes(alpha: float) -> bool:
    """Streaming DiLoCo with Int8 lands straight from the gathered codes (the fused landing
    reads them, nothing is decoded): bit for bit what decoding and then landing gives, on
    parameters that start and end inside the quantizer's blocks (SHAPES, block 8)."""
    runs = []
    for encoded in (True, False):
        comp = overlap.Int8(block=8)
        if not encoded:
            comp.encodes_result = False  # decode into the buffer, then the fused landing
        model, inner, d = _build(4, 2, 1, compression=comp, alpha=alpha)
        try:
            if encoded and d._kernels is None:
                raise AssertionError("numba is missing: the fused landing is not there")
            for t in range(1, 14):
                _inner_step(model, inner, t)
                d.step()
            d.flush()
            runs.append([p.detach().clone() for p in model.ps] + [g.clone() for g in d.globals])
        finally:
            d.remove()
    return all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def cancelled_astep_keeps_the_globals_agreed(frags: int, delay: int) -> list[Any]:
    """Rank 0 cancels its ``await d.astep()`` (asyncio.wait_for times out) at every sync
    step and goes on training; the global weights must stay the same on every rank, and
    equal to a rank that never cancelled. Before, the cancelled rank dropped the landing
    it was waiting for: its global weights missed that outer step for good."""
    r = comm.get_rank()
    model, inner, d = _build(4, frags, delay)
    out: list[Any] = []

    async def main() -> None:
        for t in range(1, 17):
            _inner_step(model, inner, t)
            nxt = d.inner_steps + 1
            due = any(nxt % d.sync_every == o for o in d.offsets) or any(
                at == nxt for at, _ in d._inflight.values()
            )
            if r == 0 and due:
                try:
                    await asyncio.wait_for(d.astep(), timeout=1e-4)
                    out.append(f"{t} at once")
                except TimeoutError:
                    out.append(f"{t} timeout")
            else:
                await d.astep()
        await d.astep()  # the last cancelled one is taken up first

    overlap.run(main())
    d.flush()
    flat = torch.cat([g.reshape(-1) for g in d.globals])
    every = comm.all_gather(flat)
    out.append(all(torch.equal(x, every[0]) for x in every))
    d.remove()
    return out


def late_landings_said(slow_rank: int, mode: str) -> list[str]:
    """Streaming DiLoCo (sync_every=8, 2 fragments, delay 2) for 24 inner steps of 20 ms on
    every rank, and 60 ms more a step on ``slow_rank`` (-1: none), so the others' landings
    wait for its issues. Returns the "arrive late" warnings this rank logged (``mode``:
    step() or astep()); raises if ``statistics()["late"]`` does not agree with them."""
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("overlap.optim.diloco")
    logger.addHandler(handler)
    model, inner, d = _build(8, 2, 2)
    try:

        async def steps() -> None:
            for t in range(1, 25):
                _inner_step(model, inner, t)
                time.sleep(0.02 + (0.06 if comm.get_rank() == slow_rank else 0))
                if mode == "async":
                    await d.astep()
                else:
                    d.step()

        overlap.run(steps())
        late = d.statistics()["late"]
    finally:
        d.remove()
        logger.removeHandler(handler)
    said = [m for m in said if "arrive late" in m]
    if late is not bool(said):
        raise AssertionError(f"statistics()['late'] is {late}, the log says {said}")
    return said


def assigned_after_build() -> list[str]:
    """A Parameter put in place of a weight after the DiLoCo was built: before, no fragment
    held it and each rank trained it on its own, silently. Now step() refuses, naming it;
    a DiLoCo built after the change syncs it."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    inner = torch.optim.SGD(m.parameters(), lr=0.1)
    dl = DiLoCo(m, inner, sync_every=2)
    m[2].weight = nn.Parameter(m[2].weight.detach().clone())
    try:
        dl.step()
        got = ["no error"]
    except ValueError as exc:
        got = [str(exc)]
    dl.remove()
    inner = torch.optim.SGD(m.parameters(), lr=0.1)
    outer = torch.optim.SGD(m.parameters(), lr=1.0)  # outer step = plain averaging
    dl = DiLoCo(m, inner, outer_optimizer=outer, sync_every=1)
    m[2].weight.data.fill_(float(comm.get_rank()))
    dl.step()  # a sync: the average of the ranks' weights
    got.append(str(m[2].weight.flatten()[0].item()))
    dl.remove()
    return got


def cast_after_build() -> list[str]:
    """``model.double()`` after the DiLoCo was built: before, its syncs ran on with float32
    global weights, silently. Now the step that would sync refuses, before it is counted;
    the steps between syncs go on."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    inner = torch.optim.SGD(m.parameters(), lr=0.1)
    dl = DiLoCo(m, inner, sync_every=3)
    got = []
    m.double()
    for _ in range(3):
        try:
            dl.step()
            got.append("ok")
        except RuntimeError as exc:
            got.append(str(exc))
    got.append(str(dl.inner_steps))
    dl.remove()
    return got


def float64_sync(frags: int) -> list[Any]:
    """A float64 model, H=1, inner and outer plain SGD at lr 1: each sync's new weights are
    the ranks' mean step taken from the globals, in float64. Returns [the pseudo-gradient
    buffers' dtypes, the largest error against that exact mean over three syncs]. Before
    the forty-seventh session the pseudo-gradient was float32: 6e-11 off on a 1e-3 step."""
    r = comm.get_rank()
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2)).double()
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    outer = torch.optim.SGD(model.parameters(), lr=1.0)
    d = DiLoCo(model, inner, outer, sync_every=1, fragments=frags)
    worst = 0.0
    try:
        for t in range(3):
            start = [p.detach().clone() for p in model.parameters()]
            for p in model.parameters():
                p.grad = torch.full_like(p, 1e-3 + 1e-9 * (r + 1) + 1e-4 * t)
            inner.step()
            d.step()
            want = [s - (1e-3 + 1.5e-9 + 1e-4 * t) for s in start]  # the mean of ranks 0, 1
            worst = max(
                worst,
                *(
                    float((p - x).abs().max())
                    for p, x in zip(model.parameters(), want, strict=True)
                ),
            )
        return [sorted({str(b.dtype) for b in d._pseudo.values()}), worst]
    finally:
        d.remove()


def unawaited_astep() -> list[Any]:
    """``diloco.astep()`` written without ``await``: before the forty-eighth session that step
    never ran and nothing said so but Python's warning (a loop of them never synced: the
    ranks' weights drifted apart). Now the next call raises, naming it. Returns [what the
    next call raised, whether the ranks' weights agree after the loop goes on right,
    whether an ``asyncio.gather`` of two asteps ran without a false alarm]."""
    r = comm.get_rank()
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    d = DiLoCo(model, inner, sync_every=2)
    out: list[Any] = []

    def inner_step() -> None:
        model(torch.randn(3, 4) + r).sum().backward()
        inner.step()
        inner.zero_grad()

    async def main() -> None:
        inner_step()
        d.astep()  # the bug: no await
        gc.collect()
        try:
            await d.astep()
            out.append("no error")
        except RuntimeError as e:
            out.append(str(e).split(":")[0])
        await d.astep()  # the dropped one, taken now: step 1 of 2
        inner_step()
        await d.astep()  # step 2: a sync
        w = model.weight.detach().clone()
        out.append(bool(torch.equal(*comm.all_gather(w))))
        inner_step()
        await asyncio.gather(d.astep(), d.astep())  # kept by gather: no false alarm
        out.append(bool(torch.equal(*comm.all_gather(model.weight.detach().clone()))))

    run_dropping(main(), d.remove)
    return out


def int8_per_parameter_error(outer_name: str, fragments: int, delay: int) -> list[float]:
    """Each parameter's change over one sync (H = 4) with Int8 pseudo-gradients, against
    the same run uncompressed (relative norm): a 300-float bias with small pseudo-gradients
    shares its fragment with weights of larger ones. ``outer_name`` "sgd" lands from the
    Int8 codes (the fused landing); "dampened" (an SGD with dampening, which the fused
    landing does not do, and as linear in the average on its first step) decodes the
    average first."""
    r = comm.get_rank()
    moved = {}
    for name in ("exact", "int8"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(7, 300), nn.Tanh(), nn.Linear(300, 3))
        start = [p.detach().clone() for p in model.parameters()]
        inner = torch.optim.SGD(model.parameters(), lr=0.05)
        outer: torch.optim.Optimizer = (
            torch.optim.SGD(model.parameters(), lr=1.0)
            if outer_name == "sgd"
            else torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.5, dampening=0.5)
        )
        dl = overlap.DiLoCo(
            model,
            inner,
            outer_optimizer=outer,
            sync_every=4,
            fragments=fragments,
            delay=delay,
            compression=overlap.Int8() if name == "int8" else None,
        )
        g = torch.Generator().manual_seed(r)
        for _ in range(4 + delay):
            model(torch.randn(5, 7, generator=g)).pow(2).mean().backward()
            inner.step()
            inner.zero_grad()
            dl.step()
        dl.finish()
        params = model.parameters()
        moved[name] = [(p.detach() - s).double() for p, s in zip(params, start, strict=True)]
        dl.remove()
    return [
        float((a - b).norm() / b.norm()) for a, b in zip(moved["int8"], moved["exact"], strict=True)
    ]
