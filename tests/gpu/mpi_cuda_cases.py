"""Run under mpiexec: several ranks sharing one GPU, over the MPI backend with CUDA tensors.

NCCL refuses two ranks on one GPU, so this is overlap's supported way to run the CUDA
scheduler with several processes on one device (MPI stages CUDA tensors through pinned host
memory unless ``OVERLAP_MPI_CUDA_AWARE=1``). Prints one line per rank,
``RESULT {json}``: {case: result | "error: traceback"}. Usage:

    mpiexec -n N python -m tests.gpu.mpi_cuda_cases
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import overlap
from overlap import comm
from overlap.compression import FP16, NoCompression, OneBit, compressed_allreduce, padded_numel
from overlap.runtime import run
from overlap.scheduler import BucketScheduler


def _model(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 8)).to(device)


def _batch(rank: int, step: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 32, generator=g).to(device)


def _reference_grads(world: int, step: int) -> list[torch.Tensor]:
    """What DDP computes: the average over ranks of each rank's gradient, here on one rank
    (every rank's batch is reproducible), in float64 so it is the exact answer."""
    model = _model("cpu").double()
    total = [torch.zeros_like(p) for p in model.parameters()]
    for r in range(world):
        model.zero_grad()
        model(_batch(r, step, "cpu").double()).pow(2).mean().backward()
        for t, p in zip(total, model.parameters(), strict=True):
            t += p.grad  # type: ignore[operator]
    return [t / world for t in total]


def scheduler_equals_reference(compression: str, mode: str) -> float:
    """Three steps of the CUDA scheduler; the worst error against the exact average."""
    rank, world = comm.get_rank(), comm.get_world_size()
    model = _model("cuda")
    comp = {"none": NoCompression(), "fp16": FP16()}[compression]
    sched = BucketScheduler(model, compression=comp, bucket_cap_mb=0.01, first_bucket_mb=0.005)
    worst = 0.0
    try:
        for step in range(3):
            model.zero_grad()
            loss = model(_batch(rank, step, "cuda")).pow(2).mean()
            if mode == "blocking":
                loss.backward()
                sched.synchronize()
            else:

                async def go(loss: torch.Tensor = loss) -> None:
                    await sched.backward(loss)

                run(go(), loop=mode)
            ref = _reference_grads(world, step)
            for p, r in zip(model.parameters(), ref, strict=True):
                assert p.grad is not None and p.grad.is_cuda
                worst = max(worst, (p.grad.double().cpu() - r).abs().max().item())
    finally:
        sched.remove()
    return worst


def no_sync_equals_reference() -> float:
    rank, world = comm.get_rank(), comm.get_world_size()
    model = _model("cuda")
    sched = BucketScheduler(model, bucket_cap_mb=0.01, first_bucket_mb=0.005)
    try:
        with sched.no_sync():
            model(_batch(rank, 0, "cuda")).pow(2).mean().backward()
        model(_batch(rank, 1, "cuda")).pow(2).mean().backward()
        sched.synchronize()
        ref = [a + b for a, b in zip(*(_reference_grads(world, s) for s in (0, 1)), strict=True)]
        return max(
            (p.grad.double().cpu() - r).abs().max().item()  # type: ignore[union-attr]
            for p, r in zip(model.parameters(), ref, strict=True)
        )
    finally:
        sched.remove()


def _scheduler_cuda_vs_cpu(make: Callable[[], Any], steps: int) -> float:
    """The same compressor (one instance per device) through the scheduler on a CUDA and a
    CPU model, same data: the worst gradient difference relative to the largest gradient."""
    rank = comm.get_rank()
    models = {d: _model(d) for d in ("cpu", "cuda")}
    scheds = {
        d: BucketScheduler(m, compression=make(), bucket_cap_mb=0.01, first_bucket_mb=0.005)
        for d, m in models.items()
    }
    worst = 0.0
    try:
        for step in range(steps):
            for d, m in models.items():
                m.zero_grad()
                m(_batch(rank, step, d)).pow(2).mean().backward()
                scheds[d].synchronize()
            for p, q in zip(models["cuda"].parameters(), models["cpu"].parameters(), strict=True):
                diff = (p.grad.cpu() - q.grad).abs()  # type: ignore[union-attr,operator]
                scale = q.grad.abs().max().item() or 1.0  # type: ignore[union-attr]
                worst = max(worst, diff.max().item() / scale)
    finally:
        for s in scheds.values():
            s.remove()
    return worst


def onebit_scheduler_cuda_equals_cpu() -> float:
    """OneBit through the scheduler: the CUDA model's gradients equal the CPU model's (same
    data, same error feedback), step after step."""
    return _scheduler_cuda_vs_cpu(lambda: OneBit(warmup_steps=1), 4)


def codec_cuda_equals_cpu() -> dict[str, Any]:
    """compressed_allreduce on CUDA tensors against the same call on CPU tensors, at several
    sizes, over 3 steps of error feedback: the first step (no error yet) must agree to float
    rounding, later steps may differ only where float rounding flips a sign near zero."""
    rank, world = comm.get_rank(), comm.get_world_size()
    out: dict[str, Any] = {}
    for n in (8, 1000, 8 * world * 1024 + 3, 1 << 18):
        g = torch.Generator().manual_seed(rank * 7919 + n)
        xs = [torch.randn(n, generator=g) for _ in range(3)]
        P = padded_numel(n, world)
        res: dict[str, list[torch.Tensor]] = {}
        for d in ("cpu", "cuda"):
            we = torch.zeros(P, device=d)
            se = torch.zeros(P // world, device=d)
            res[d] = []
            for x in xs:
                buf = x.clone().to(d)
                compressed_allreduce(buf, we, se)
                res[d].append(buf.cpu())
        first = (res["cuda"][0] - res["cpu"][0]).abs().max().item()
        scale = res["cpu"][0].abs().max().item() or 1.0
        mism = [
            ((a - b).abs() > 1e-4 * (b.abs().max().item() or 1.0)).float().mean().item()
            for a, b in zip(res["cuda"][1:], res["cpu"][1:], strict=True)
        ]
        out[str(n)] = {"first_rel": first / scale, "later_mismatch_fraction": max(mism)}
    return out


def quantized_scheduler_cuda_equals_cpu(name: str) -> float:
    """Int8 / FP8 through the scheduler: the CUDA model's gradients (torch ops) against the
    CPU model's (Int8: the numba kernels), 3 steps with error feedback. Worst difference
    relative to the largest gradient: CUDA's gradients differ from CPU's by float rounding,
    which can move a value across a code boundary (one step is 1/127 of a block's maximum for
    Int8, up to 1/14 for FP8 e4m3 near the top of its range)."""
    make = {"int8": overlap.Int8, "fp8": overlap.FP8}[name]
    return _scheduler_cuda_vs_cpu(lambda: make(block=64), 3)


def diloco_cuda_equals_cpu(compression: str) -> dict[str, float]:
    """Streaming DiLoCo (2 fragments, delay 1, H=4) on a CUDA model against the same run on a
    CPU model: the parameters after 10 inner steps (two syncs per fragment, one landing while
    the next inner steps run), worst difference relative to the largest parameter, and how far
    apart the ranks' CUDA global parameters are after a flush (the outer step is the same on
    every rank, so 0; a fragment's local parameters differ by design until it syncs)."""
    rank = comm.get_rank()
    comp = {"none": lambda: None, "int8": lambda: overlap.Int8(block=64)}[compression]
    models = {d: _model(d) for d in ("cpu", "cuda")}
    runs = {}
    for d, m in models.items():
        inner = torch.optim.AdamW(m.parameters(), lr=1e-2)
        runs[d] = (
            inner,
            overlap.DiLoCo(m, inner, sync_every=4, fragments=2, delay=1, compression=comp()),
        )
    worst = 0.0
    try:
        for step in range(10):
            for d, m in models.items():
                inner, dl = runs[d]
                m(_batch(rank, step, d)).pow(2).mean().backward()
                inner.step()
                inner.zero_grad()
                dl.step()
        for _, dl in runs.values():
            dl.flush()
        for p, q in zip(models["cuda"].parameters(), models["cpu"].parameters(), strict=True):
            scale = q.detach().abs().max().item() or 1.0
            worst = max(worst, (p.detach().cpu() - q.detach()).abs().max().item() / scale)
        flat = torch.cat([g.reshape(-1) for g in runs["cuda"][1].globals])
        ref = flat.clone()
        comm.broadcast(ref, src=0)
        same = float((flat - ref).abs().max().item())
    finally:
        for _, dl in runs.values():
            dl.remove()
    return {"vs_cpu": worst, "across_ranks": same}


def coalesced_on_cuda() -> bool:
    """all_reduce_coalesced and all_gather_coalesced with CUDA tensors of two dtypes over MPI."""
    rank, world = comm.get_rank(), comm.get_world_size()
    ts = [torch.full((5,), float(rank), device="cuda"),
          torch.full((3,), rank + 1, dtype=torch.int64, device="cuda")]  # fmt: skip
    comm.all_reduce_coalesced(ts)
    ok = ts[0].tolist() == [world * (world - 1) / 2] * 5
    ok = ok and ts[1].tolist() == [world * (world + 1) // 2] * 3
    ins = [torch.full((2,), float(rank), device="cuda")]
    outs = [torch.empty(2 * world, device="cuda")]
    comm.all_gather_coalesced(outs, ins, async_op=True).wait(60)
    return ok and outs[0].tolist() == [float(k) for k in range(world) for _ in range(2)]


CASES: dict[str, Callable[[], Any]] = {
    "none/blocking": lambda: scheduler_equals_reference("none", "blocking"),
    "none/uvloop": lambda: scheduler_equals_reference("none", "uvloop"),
    "none/asyncio": lambda: scheduler_equals_reference("none", "asyncio"),
    "fp16/blocking": lambda: scheduler_equals_reference("fp16", "blocking"),
    "no_sync": no_sync_equals_reference,
    "onebit_cuda_vs_cpu": onebit_scheduler_cuda_equals_cpu,
    "codec_cuda_vs_cpu": codec_cuda_equals_cpu,
    "int8_cuda_vs_cpu": lambda: quantized_scheduler_cuda_equals_cpu("int8"),
    "fp8_cuda_vs_cpu": lambda: quantized_scheduler_cuda_equals_cpu("fp8"),
    "diloco_cuda_vs_cpu": lambda: diloco_cuda_equals_cpu("none"),
    "diloco_int8_cuda_vs_cpu": lambda: diloco_cuda_equals_cpu("int8"),
    "coalesced_on_cuda": coalesced_on_cuda,
}


def main() -> None:
    overlap.init_distributed(dist_backend="mpi", timeout=120)
    torch.cuda.set_device(0)
    results: dict[str, Any] = {"rank": comm.get_rank(), "world": comm.get_world_size()}
    for name, fn in CASES.items():
        try:
            results[name] = fn()
        except Exception:
            results[name] = "error: " + traceback.format_exc()[-3000:]
        comm.barrier()
    sys.stdout.write("RESULT " + json.dumps(results) + "\n")
    sys.stdout.flush()
    comm.destroy_process_group()


if __name__ == "__main__":
    main()
