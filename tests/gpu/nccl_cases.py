"""Rank functions for the GPU layer: run in a real NCCL rank (world size 1, one GPU).

Each function is called through ``RankPool(1, backend="nccl")`` and returns plain data that
the test asserts on. NCCL refuses two ranks on one GPU, so the multi-rank CUDA cases run over
MPI with CUDA tensors instead (tests/gpu/mpi_cuda_cases.py).
"""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import nn

from overlap import comm
from overlap.comm.steps import Steps
from overlap.compression import FP16, NoCompression, OneBit
from overlap.compression.base import Compressor
from overlap.runtime import run
from overlap.scheduler import BucketScheduler
from tests.loop_ticks import LoopTicks

# ~1.3e8 cycles: 65-90 ms at an H100/H200's 1.4-2 GHz. Long enough that a missing stream wait
# cannot hide behind host latency, short enough for a suite that runs in minutes.
SLEEP_CYCLES = 130_000_000


def _model(seed: int = 0, device: str = "cuda") -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 16)
    ).to(device)


def _batches(n: int, device: str = "cuda") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randn(32, 64, generator=g).to(device) for _ in range(n)]


def _compressor(name: str) -> Compressor:
    return {"none": NoCompression(), "fp16": FP16(), "onebit": OneBit(warmup_steps=0)}[name]


def scheduler_equals_ddp(compression: str, mode: str, grad_as_view: bool = False) -> float:
    """Three steps (the second rebuilds the buckets) of a CUDA model under the scheduler and
    under DDP; returns the largest gradient difference seen."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ours, theirs = _model(), _model()
    ddp = DDP(theirs)
    sched = BucketScheduler(
        ours,
        compression=_compressor(compression),
        bucket_cap_mb=0.1,
        first_bucket_mb=0.02,
        gradient_as_bucket_view=grad_as_view,
    )
    worst = 0.0
    try:
        for x in _batches(3):
            for m in (ours, ddp):
                m.zero_grad()
            if mode == "blocking":
                ours(x).pow(2).mean().backward()
                sched.synchronize()
            else:

                async def step(x: torch.Tensor = x) -> None:
                    await sched.backward(ours(x).pow(2).mean())

                run(step(), loop=mode)
            ddp(x).pow(2).mean().backward()
            for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
                assert p.grad is not None and q.grad is not None
                assert p.grad.is_cuda
                worst = max(worst, (p.grad - q.grad).abs().max().item())
    finally:
        sched.remove()
    return worst


def no_sync_equals_ddp() -> float:
    """Two micro-batches under no_sync, one with sync, against DDP doing the same."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ours, theirs = _model(), _model()
    ddp = DDP(theirs)
    sched = BucketScheduler(ours, bucket_cap_mb=0.1, first_bucket_mb=0.02)
    xs = _batches(3)
    try:
        with sched.no_sync():
            for x in xs[:2]:
                ours(x).pow(2).mean().backward()
        ours(xs[2]).pow(2).mean().backward()
        sched.synchronize()
        with ddp.no_sync():
            for x in xs[:2]:
                ddp(x).pow(2).mean().backward()
        ddp(xs[2]).pow(2).mean().backward()
        return max(
            (p.grad - q.grad).abs().max().item()  # type: ignore[operator]
            for p, q in zip(ours.parameters(), theirs.parameters(), strict=True)
        )
    finally:
        sched.remove()


class SlowDouble(Compressor):
    """Doubles the bucket after a long GPU sleep on whatever stream it runs on, and records
    which stream that was. A read of the gradients that does not wait for the side stream sees
    the un-doubled values."""

    name = "slow-double"
    summable = True

    def __init__(self) -> None:
        self.streams: list[int] = []

    def reduce_steps(
        self,
        key: Hashable,
        flat: torch.Tensor,
        *,
        group: Any = None,
        shapes: Sequence[torch.Size] | None = None,
    ) -> Steps:
        self.streams.append(torch.cuda.current_stream().cuda_stream)
        torch.cuda._sleep(SLEEP_CYCLES)
        flat.mul_(2)
        yield [comm.all_reduce(flat, op="avg", group=group, async_op=True)]
        return flat


def side_stream_wait(disable_wait: bool = False) -> dict[str, Any]:
    """Every bucket runs on the side stream; after synchronize() the compute stream reads the
    doubled gradients, and CUDA events show it waited for the side stream's sleep.

    ``disable_wait=True`` removes the compute stream's wait (a negative control: the read then
    sees the un-doubled gradients, which shows this case can fail)."""
    model = _model()
    x = _batches(1)[0]
    model(x).pow(2).mean().backward()
    ref = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    comp = SlowDouble()
    sched = BucketScheduler(
        model, compression=comp, bucket_cap_mb=0.1, first_bucket_mb=0.02, rebuild_buckets=False
    )
    if disable_wait:
        sched._launcher.wait_compute = lambda: None  # type: ignore[method-assign]
    try:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        t0 = time.perf_counter()
        model(x).pow(2).mean().backward()
        sched.synchronize()
        host_s = time.perf_counter() - t0
        got = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        end.record()
        torch.cuda.synchronize()
        ok = all(torch.equal(g, 2 * r) for g, r in zip(got, ref, strict=True))
        compute = torch.cuda.current_stream().cuda_stream
        return {
            "correct": ok,
            "buckets": len(sched.buckets),
            "on_side_stream": bool(comp.streams) and all(s != compute for s in comp.streams),
            "side_streams": len(set(comp.streams)),
            "gpu_ms": start.elapsed_time(end),
            "host_ms": host_s * 1e3,
            "sleep_ms": _sleep_ms(),
        }
    finally:
        sched.remove()


def _sleep_ms() -> float:
    """How long one SLEEP_CYCLES sleep takes on this GPU (CUDA events)."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    torch.cuda._sleep(SLEEP_CYCLES)
    e.record()
    e.synchronize()
    return float(s.elapsed_time(e))


def _as_steps(fn: Callable[[], None]) -> Steps:
    """``fn`` as a steps generator that issues no handle (what Launcher.submit_steps runs)."""
    fn()
    return
    yield []  # pragma: no cover - makes this a generator


def record_stream_stress(rounds: int, record: bool = True) -> int:
    """Free a bucket while a side-stream job still reads it, reallocate the same memory on the
    compute stream and overwrite it; return how many rounds gave a wrong result.

    With ``record=True`` this goes through the scheduler's Launcher (which calls
    ``record_stream``); with ``record=False`` it does the same by hand without it (a
    negative control: the caching allocator hands the block straight back)."""
    from overlap.scheduler.streams import Launcher

    n = 1 << 20
    launcher = Launcher(torch.device("cuda"))
    bad = 0
    try:
        for i in range(rounds):
            # The job takes the only other reference out of `holder` and drops it once its
            # kernels are issued: from then on nothing in Python keeps the bucket alive, as
            # when a scheduler's buckets are rebuilt or removed with reductions in flight.
            holder = [torch.full((n,), float(i + 1), device="cuda")]
            out = torch.empty(n, device="cuda")
            done: list[BaseException | None] = []

            def job(holder: list[torch.Tensor] = holder, out: torch.Tensor = out) -> None:
                flat = holder.pop()
                torch.cuda._sleep(SLEEP_CYCLES // 4)
                torch.mul(flat, 2, out=out)

            if record:
                launcher.submit_steps(_as_steps(job), done.append, holder[0])
                while not done:  # the job's kernels are issued, its references dropped
                    time.sleep(0.0005)
            else:
                side = launcher.stream
                ready = torch.cuda.Event()
                ready.record()
                with torch.cuda.stream(side):
                    side.wait_event(ready)
                    job()
            # the bucket's block is free now; the side stream still sleeps before reading it
            junk = torch.empty(n, device="cuda")  # same size: the allocator's cached block
            junk.fill_(float("nan"))
            if record:
                launcher.wait_compute()
            else:
                torch.cuda.current_stream().wait_stream(launcher.stream)
            if not torch.equal(out, torch.full_like(out, 2.0 * (i + 1))):
                bad += 1
            del junk
        return bad
    finally:
        launcher.close()


def scheduler_churn(steps: int) -> float:
    """Many steps with the slow compressor while the compute stream allocates, fills and
    frees gradient-sized memory during the reductions; returns the largest error."""
    model = _model()
    xs = _batches(4)
    refs = []
    for x in xs:
        model.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        refs.append([2 * p.grad for p in model.parameters()])  # type: ignore[operator]
    model.zero_grad(set_to_none=True)
    sched = BucketScheduler(
        model, compression=SlowDouble(), bucket_cap_mb=0.05, first_bucket_mb=0.01
    )
    worst = 0.0
    try:
        for i in range(steps):
            model.zero_grad(set_to_none=i % 2 == 0)
            model(xs[i % 4]).pow(2).mean().backward()
            churn = [torch.full((p.numel(),), float("nan"), device="cuda") for p in sched.params]
            del churn
            sched.synchronize()
            for p, r in zip(model.parameters(), refs[i % 4], strict=True):
                worst = max(worst, (p.grad - r).abs().max().item())  # type: ignore[operator]
    finally:
        sched.remove()
    return worst


def awaited_nccl_op(loop: str) -> dict[str, Any]:
    """An all_reduce whose input is written after a long GPU sleep: awaiting it returns
    before the GPU is done (no host sync), the loop keeps ticking meanwhile, and the value read
    after the await (stream-ordered) is right. CUDA events time the op."""
    n = 1 << 16

    async def main() -> dict[str, Any]:
        # NCCL creates its communicator at a group's first collective, synchronously: do that
        # first so the timed op is a steady-state one.
        await comm.all_reduce(torch.ones(1, device="cuda"), async_op=True)
        torch.cuda.synchronize()
        async with LoopTicks() as ticks:
            await asyncio.sleep(0)
            t = torch.zeros(n, device="cuda")
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            torch.cuda._sleep(SLEEP_CYCLES)
            t.fill_(3.0)
            t0 = time.perf_counter()
            h = comm.all_reduce(t, op="sum", async_op=True)
            before = ticks.count
            out = await h
            await_ms = (time.perf_counter() - t0) * 1e3
            during = ticks.count - before
            e.record()
            total = out.sum()  # ordered after the collective on this stream
            value = total.item()
        return {
            "value": value,
            "expected": 3.0 * n,
            "await_ms": await_ms,
            "gpu_ms": s.elapsed_time(e),
            "ticks_during_await": during,
            "done_after": h.done(),
        }

    return run(main(), loop=loop)


def issued_on_side_stream() -> bool:
    """An op issued under ``torch.cuda.stream(s)`` and awaited on the loop thread is ordered
    on ``s``: reading the result on ``s`` right after the await gives the reduced values."""
    s = torch.cuda.Stream()
    n = 1 << 16

    async def main() -> bool:
        t = torch.zeros(n, device="cuda")
        s.wait_stream(torch.cuda.current_stream())  # t was made on the default stream
        with torch.cuda.stream(s):
            torch.cuda._sleep(SLEEP_CYCLES // 4)
            t.fill_(5.0)
            h = comm.all_reduce(t, op="sum", async_op=True)
        out = await h
        with torch.cuda.stream(s):
            got = out.clone()
        s.synchronize()
        return bool(torch.equal(got, torch.full_like(got, 5.0)))

    return run(main())


def traced_scheduler_report() -> dict[str, Any]:
    """A traced CUDA scheduler: GPU-timed bucket spans resolve without a device-wide sync and
    the overlap report reads them."""
    from overlap.trace import Tracer

    tracer = Tracer()
    model = _model()
    sched = BucketScheduler(
        model,
        compression=OneBit(warmup_steps=1),
        bucket_cap_mb=0.1,
        first_bucket_mb=0.02,
        tracer=tracer,
    )
    try:
        for x in _batches(3):
            model.zero_grad()
            with tracer.span("forward"):
                loss = model(x).pow(2).mean()
            loss.backward()
            sched.synchronize()
        torch.cuda.synchronize()
        pending = tracer.resolve_device()
        dev = [s for s in tracer.spans if s[5].get("device")]
        rep = tracer.report().to_dict()
        return {
            "pending": pending,
            "device_spans": len(dev),
            "device_names": sorted({s[0] for s in dev}),
            "report_steps": len(rep.get("steps", [])),
            "report": rep,
        }
    finally:
        sched.remove()
        tracer.detach()


def ds_comm_on_cuda() -> dict[str, Any]:
    """deepspeed.comm's added ops with CUDA tensors on NCCL (one rank): coalesced ops, object
    collectives (bytes through CUDA tensors), monitored_barrier, the comms logger timing an
    awaited op, and a device mesh."""
    from overlap.comm import comms_logger

    dev = torch.device("cuda")
    ts = [torch.full((5,), 2.0, device=dev), torch.full((3,), 7, dtype=torch.int64, device=dev)]
    comm.all_reduce_coalesced(ts)
    h = comm.all_reduce_coalesced(ts, op="max", async_op=True)
    h.wait(60)
    outs = [torch.empty(5, device=dev), torch.empty(3, dtype=torch.int64, device=dev)]
    comm.all_gather_coalesced(outs, ts)
    got: list[Any] = [None]
    comm.all_gather_object(got, {"gpu": True})
    objs: list[Any] = [None, None]
    if comm.get_rank() == 0:
        objs = ["a", {"b": 1}]
    comm.broadcast_object_list(objs, 0)
    comm.monitored_barrier(timeout=30)
    lg = comms_logger.LOGGER
    saved = (lg.enabled, lg.prof_all)
    comm.reset_log()
    try:
        comm.configure(enabled=True, prof_all=False)
        comm.all_reduce(torch.ones(256, device=dev), async_op=True, prof=True).wait(60)
        time.sleep(0.05)
        summary = comm.log_summary(return_dict=True, file=io.StringIO())
    finally:
        lg.enabled, lg.prof_all = saved
        comm.reset_log()
    mesh = comm.initialize_mesh_device((1,), ("dp",))
    return {
        "coalesced": ts[0].tolist() == [2.0] * 5 and ts[1].tolist() == [7] * 3,
        "gathered": torch.equal(outs[0], ts[0]) and torch.equal(outs[1], ts[1]),
        "objects": got == [{"gpu": True}] and objs == ["a", {"b": 1}],
        "logged": summary is not None and summary["summary"]["all_reduce"][1024]["count"] == 1,
        "mesh": mesh is not None and mesh.device_type == "cuda",
    }


def hierarchical_on_nccl() -> dict[str, Any]:
    """A Hierarchical reduction on NCCL (one rank: one host of one rank), which the CUDA
    buckets take through its socket path. Its control collectives (the shared-memory token
    at construction, each chunk's outcome vote) must be CUDA tensors there: they were CPU
    ones, and the constructor raised. With NoCompression inside, the gradients are the
    plain ones; with OneBit, a NaN in step 1 gives NonFiniteError ("raise") or
    last_skipped ("skip"), and the next step trains on."""
    from overlap.errors import NonFiniteError
    from overlap.scheduler.hierarchy import Hierarchical

    def nan_at_00(g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        g[0, 0] = float("nan")
        return g

    model = _model()
    x = _batches(1)[0]
    sched = BucketScheduler(model, compression=Hierarchical(NoCompression(), 1, 1))
    model(x).pow(2).mean().backward()
    sched.synchronize()
    ours = [p.grad.clone() for p in model.parameters()]
    sched.remove()
    model.zero_grad()
    model(x).pow(2).mean().backward()
    plain = [p.grad for p in model.parameters()]
    out: dict[str, Any] = {
        "none_err": max(float((a - b).abs().max()) for a, b in zip(ours, plain, strict=True))
    }
    for mode in ("raise", "skip"):
        onebit = OneBit(on_nonfinite=mode)
        sched = BucketScheduler(model, compression=Hierarchical(onebit, 1, 1))
        steps = []
        for step, x in enumerate(_batches(3)):
            model.zero_grad()
            hook = model[0].weight.register_hook(nan_at_00) if step == 1 else None
            model(x).pow(2).mean().backward()
            if hook is not None:
                hook.remove()
            try:
                sched.synchronize()
                finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
                steps.append("skipped" if onebit.last_skipped else f"ok finite={finite}")
            except NonFiniteError:
                steps.append("NonFiniteError")
        out[mode] = steps
        sched.remove()
    return out


def diloco_run(compression: str, mode: str, device: str) -> dict[str, Any]:
    """Streaming DiLoCo (2 fragments, delay 1, H=4) on a model on ``device`` over the job's
    backend (NCCL for "cuda": its fragment reductions, the driver's phases and finish()'s
    vote as NCCL collectives; gloo for "cpu", the reference): 10 inner steps, each followed
    by step() ("blocking") or astep() in a uvloop loop ("uvloop"), then finish(). Returns
    the parameters and buffers (on the CPU), how far the local weights are from the global
    ones after finish() (0: the rank holds the global weights) and the statistics. With one rank the
    average is the rank's own pseudo-gradient: the two runs differ by the device's
    arithmetic, not the schedule, so a path that never ran on NCCL shows as a raise or a
    difference."""
    import overlap

    comp = {"none": lambda: None, "int8": lambda: overlap.Int8(block=64)}[compression]
    # a BatchNorm at the end: finish() syncs its buffers too (float ones averaged, the int64
    # counter broadcast), here as NCCL collectives on CUDA buffers
    model = nn.Sequential(_model(device=device), nn.BatchNorm1d(16).to(device))
    # SGD, not AdamW: Adam's update is about lr * sign(g) where g is near 0, so the GEMMs'
    # rounding (CUDA against CPU) flipped some updates; seen on an H100 with AdamW: 8.8e-4
    # relative after 10 steps, though the runs agreed on every sync (Int8 within 2e-2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = overlap.DiLoCo(model, inner, sync_every=4, fragments=2, delay=1, compression=comp())
    xs = _batches(10, device)

    def inner_step(x: torch.Tensor) -> None:
        model(x).pow(2).mean().backward()
        inner.step()
        inner.zero_grad()

    async def steps_async() -> None:
        for x in xs:
            inner_step(x)
            await dl.astep()
        await dl.afinish()

    try:
        if mode == "uvloop":
            run(steps_async(), loop="uvloop")
        else:
            for x in xs:
                inner_step(x)
                dl.step()
            dl.finish()
        apart = max(
            float((p.detach() - g.detach()).abs().max())
            for p, g in zip(model.parameters(), dl.globals, strict=True)
        )
        stats = dl.statistics()
    finally:
        dl.remove()
    return {
        "params": [p.detach().cpu() for p in model.parameters()],
        "buffers": [b.detach().cpu() for b in model.buffers()],
        "apart": apart,
        "stats": stats,
    }
