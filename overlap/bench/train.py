"""``overlap bench train``: step time of DDP and overlap variants on one model, one run.

Every variant trains the same MLP (``--model-size`` million parameters, 2048-wide layers) on
the same data; the variants are interleaved step by step so noise hits them alike (DiLoCo
variants run their steps back to back afterwards: their reductions run in the background
across steps and would slow an interleaved neighbour).

``--device cuda`` runs the model on the GPU with NCCL (one rank per GPU: NCCL refuses two
ranks on one device). At world size 1 there is no wire, so it measures what the scheduler
itself costs on a GPU against DDP's C++ reducer. Each CUDA step ends with a device
synchronize, so step times are GPU times, not launch times. Reported
per variant (rank 0, median over steps): step time, bytes sent per rank per step, and for
overlap variants the communication timeline: total comm time (union of bucket reductions),
hidden comm (the part that ran during backward), exposed comm (the wait in synchronize) and
the overlap ratio hidden / total.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import nn

from overlap.bench.harness import Progress, median, ratio_interval
from overlap.bench.stopping import interrupt_once

__all__ = ["VARIANTS", "bench_train_rank"]

VARIANTS = [
    "compute",
    "ddp",
    "ddp-fp16",
    "ddp-powersgd",
    "overlap-none",
    "overlap-fp16",
    "overlap-onebit",
    "overlap-powersgd",
    "overlap-auto",
]
# With several hosts (--hosts): the 1-bit scheduler without its hierarchical reduction
# (overlap-onebit is hierarchical there: hierarchy="auto" picks node).
HOST_VARIANTS = ["overlap-onebit-flat"]
# Adam variants (run only when named): DDP with AdamW, 1-bit Adam overlapped by the
# scheduler, and 1-bit Adam standalone (DeepSpeed's serial form: backward, then step()
# communicates). Their "vs DDP" is against ddp-adamw when it runs too.
ADAM_VARIANTS = ["ddp-adamw", "overlap-onebitadam", "onebitadam-serial"]
# DiLoCo (run only when named): SGD inner steps, an outer sync every DILOCO_H steps: plain
# (the whole model, fp32, waited for at the sync step) and streaming (8 fragments in turn,
# Int8, each landing about H // 2 steps after it was issued: time for a slow link;
# streaming_delay).
DILOCO_VARIANTS = ["diloco", "diloco-streaming"]
# --pin-heap: glibc's malloc settings for the rank processes (read from the environment
# they start with): freed memory stays in the heap instead of going back to the OS, and the
# heap is backed by transparent huge pages where the kernel gives them on request (THP
# "madvise"; glibc 2.35 and later, older ones ignore it), so a heap that still grows (a
# 16 MiB gradient that no longer fits its freed place) faults 2 MiB pages, not 4 KiB ones.
# Measured, streaming DiLoCo at 1 Gbit/s (docs/diloco.md): 3,300-4,000 faults on the
# training thread in 32 steps, 3-10 with the tunable.
PIN_HEAP_ENV = {
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1",
}
# H of both DiLoCo variants (--diloco-sync-every, passed to the rank processes in their
# environment); streaming's delay is about H // 2 (streaming_delay). 32 since the
# thirty-fifth session, 8 before: a schedule has to fit the link, and at the 100
# Mbit/s H = 8 does not at this model's steps (streaming's Int8 sends 1 MiB a rank a step
# at 8.4M parameters, 184 Mbit/s at 46 ms steps: its landings waited, DiLoCo said so, and
# the slowest step was 7-10x compute-only's); at 32 both links fit. The sync's CPU a step
# falls as 1 / H, which is what streaming's steps pay over compute-only on a machine whose
# ranks have no idle core (this 2-core one: median 1.09-1.14x at H = 8, within 1.05x in 9
# of 14 runs at H = 32; docs/diloco.md, "H for the link and the cores"). H = 8 is the H of
# the convergence figures (``overlap bench lm``); ``--diloco-sync-every 8`` gives it here.
DILOCO_H = 32
DILOCO_H_ENV = "OVERLAP_BENCH_DILOCO_H"
# --diloco-fragments: streaming DiLoCo's fragment count, passed to the rank processes in
# their environment. 8 (one issued every H / 8 steps): the model's 12 tensors (six
# 4.2M-float weights) then cut into fragments of at most one weight; 4 cut them
# 8.4M/4.2M/8.4M/4.2M, and the steps that issued and landed an 8.4M fragment were the
# slowest (docs/diloco.md, tenth session, at H = 8: slowest step 1.21-1.39x compute-only
# with 8, 1.32-1.71x with 4).
DILOCO_FRAGMENTS_ENV = "OVERLAP_BENCH_DILOCO_FRAGMENTS"
DILOCO_FRAGMENTS = 8
# --threads: torch's intra-op threads per rank, passed in the ranks' environment. 1 by
# default, so that every variant's ranks share the machine alike and compute is steady;
# more lets a machine with cores to spare compute faster, which is where a link's cost
# can show (with one thread a rank at 1 Gbit/s, compute and the codec's CPU fill the step,
# and hierarchy="node", which halves the bytes between hosts, has little to gain there).
THREADS_ENV = "OVERLAP_BENCH_THREADS"
# --diloco-pass-thread: DiLoCo(pass_thread=) of the DiLoCo variants: auto (None), on, off
DILOCO_PASS_THREAD_ENV = "OVERLAP_BENCH_DILOCO_PASS_THREAD"
# --diloco-background: DiLoCo(background=) of the DiLoCo variants: auto (None), on, off
DILOCO_BACKGROUND_ENV = "OVERLAP_BENCH_DILOCO_BACKGROUND"
ALL_VARIANTS = VARIANTS + HOST_VARIANTS + ADAM_VARIANTS + DILOCO_VARIANTS
# On a GPU at world size 1 (no wire) the variants that matter are the scheduler's overhead.
CUDA_VARIANTS = ["compute", "ddp", "ddp-fp16", "overlap-none", "overlap-fp16", "overlap-onebit"]
WIDTH = 2048
# Step index at which the compressed variants start compressing (OneBit's warm-up steps,
# PowerSGD's start iteration): the bench reports that step's time, to show any first-step
# stall (a kernel compile, a layout build).
COMPRESS_FROM = 2


def _layers(million: float) -> int:
    return max(1, round(million * 1e6 / (WIDTH * WIDTH + WIDTH)))


def model_params(million: float) -> int:
    """The parameter count of the bench's model for ``--model-size million``."""
    return _layers(million) * (WIDTH * WIDTH + WIDTH)


def _model(million: float, device: str = "cpu") -> nn.Module:
    layers = _layers(million)
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(layers)]
    ).to(device)


def _union(
    intervals: list[tuple[float, float]], lo: float = float("-inf"), hi: float = float("inf")
) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        a, b = max(a, lo, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total


def comm_overlap(timeline: list[dict[str, Any]], t0: float, t_bwd: float) -> tuple[float, float]:
    """(comm, hidden) seconds of one step from a scheduler timeline: the union of the bucket
    reductions, and the part of it that ran while backward did (between t0 and t_bwd)."""
    iv = [(e["start"], e["end"]) for e in timeline]
    return _union(iv), _union(iv, t0, t_bwd)


def diloco_fragments() -> int:
    """Streaming DiLoCo's fragment count for this run (``--diloco-fragments``)."""
    return int(os.environ.get(DILOCO_FRAGMENTS_ENV, DILOCO_FRAGMENTS))


def diloco_sync_every() -> int:
    """Both DiLoCo variants' ``sync_every`` for this run (``--diloco-sync-every``)."""
    return int(os.environ.get(DILOCO_H_ENV, DILOCO_H))


def streaming_delay(h: int, fragments: int) -> int:
    """diloco-streaming's delay: about H / 2 (time for a slow link), moved back by half the
    steps between two issues so that a landing falls midway between them, not on an issue
    step. Fragment i issues at ((i + 1) H // F) % H, so with H // 2 and H / F even every
    landing fell on the step that issued another fragment (H = 32, F = 8: both every 4th
    step), and that step carried both. Measured, 2 cores, 7 rounds alternated (docs/diloco.md,
    "Landings between issues"): the issuing steps' median 143 -> 134 ms, the slowest step's
    median over the runs 1.38 -> 1.27x compute-only's."""
    if h < 2:
        return 0
    gap, half = max(h // max(fragments, 1), 1), h // 2
    return max(half - (half - gap // 2) % gap, 1) if gap > 1 else half


def _on_off_auto(env: str) -> bool | None:
    return {"on": True, "off": False}.get(os.environ.get(env, "auto"))


def diloco_pass_thread() -> bool | None:
    """The DiLoCo variants' ``pass_thread`` for this run (``--diloco-pass-thread``)."""
    return _on_off_auto(DILOCO_PASS_THREAD_ENV)


def diloco_background() -> bool | None:
    """The DiLoCo variants' ``background`` for this run (``--diloco-background``)."""
    return _on_off_auto(DILOCO_BACKGROUND_ENV)


def _variant(name: str, million: float, device: str = "cpu") -> dict[str, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from overlap import BucketScheduler, OneBitAdam
    from overlap.compression import FP16, Auto, NoCompression, OneBit, PowerSGD

    model = _model(million, device)
    v: dict[str, Any] = {"name": name, "model": model, "sched": None, "diloco": None}
    if name in DILOCO_VARIANTS:
        from overlap import DiLoCo, Int8

        v["forward"] = model
        v["opt"] = torch.optim.SGD(model.parameters(), lr=1e-4)
        stream = name == "diloco-streaming"
        h = diloco_sync_every()
        f = min(diloco_fragments(), len(list(model.parameters()))) if stream else 1
        v["diloco"] = DiLoCo(
            model,
            v["opt"],
            sync_every=h,
            fragments=f,
            delay=streaming_delay(h, f) if stream else 0,
            compression=Int8() if stream else None,
            pass_thread=diloco_pass_thread(),
            background=diloco_background(),
        )
        return v
    if "onebitadam" in name:
        v["forward"] = model
        v["opt"] = OneBitAdam(model.parameters(), lr=1e-4, freeze_step=COMPRESS_FROM)
        if name.startswith("overlap"):
            v["sched"] = BucketScheduler(model, optimizer=v["opt"])
        return v
    if name.startswith("ddp"):
        # DDP's PowerSGD hook issues its 2nd and 3rd allreduce from gloo's callback thread;
        # with several buckets they race with the next bucket's allreduce from autograd and
        # the ranks' op orders diverge (measured: gloo "Received data size doesn't match" in
        # 6 of 6 runs at 25.2M params). One bucket keeps that baseline correct.
        cap = 4096 if name == "ddp-powersgd" else 25
        ddp = DDP(model, bucket_cap_mb=cap)
        if name == "ddp-fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif name == "ddp-powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2
            )
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        v["forward"] = ddp
    else:
        v["forward"] = model
        if name.startswith("overlap"):
            comp = {
                "overlap-none": NoCompression(),
                "overlap-fp16": FP16(),
                "overlap-onebit": OneBit(warmup_steps=COMPRESS_FROM),
                "overlap-powersgd": PowerSGD(rank=1, start_iter=COMPRESS_FROM),
                "overlap-auto": Auto(),
                "overlap-onebit-flat": OneBit(warmup_steps=COMPRESS_FROM),
            }[name]
            flat = name.endswith("-flat")
            v["sched"] = BucketScheduler(
                model, compression=comp, hierarchy="flat" if flat else "auto"
            )
    if name == "ddp-adamw":
        v["opt"] = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    else:
        v["opt"] = torch.optim.SGD(model.parameters(), lr=1e-4)
    return v


@interrupt_once  # a rank stopped by Ctrl-C says nothing more
def bench_train_rank(
    variants: list[str],
    steps: int,
    warmup: int,
    million: float,
    batch: int = 64,
    device: str = "cpu",
) -> list[dict[str, Any]]:
    from overlap import comm
    from overlap.compression import compressed_bytes

    threads = int(os.environ.get(THREADS_ENV, "1"))
    torch.set_num_threads(threads)
    cuda = device == "cuda"
    w = comm.get_world_size()
    vs = [_variant(n, million, device) for n in variants]
    nparams = sum(p.numel() for p in vs[0]["model"].parameters())
    gen = torch.Generator().manual_seed(comm.get_rank())
    rec: dict[str, dict[str, list[float]]] = {
        v["name"]: {
            k: []
            for k in (
                "step",
                "comm",
                "hidden",
                "exposed",
                "all",
                "backward",
                "cpu",
                "proc",
                "sync",
                "sync_wait",
                "rewarm",
                "own",
            )
        }
        for v in vs
    }
    worker: dict[str, list[float]] = {v["name"]: [] for v in vs}  # worker CPU s after each step
    n_diloco = sum(v["diloco"] is not None for v in vs)
    # compute-only's re-warm before its second half, and each DiLoCo variant's own
    # compute-only sandwich with its re-warm, when DiLoCo variants run (the solo phase)
    has_compute = any(v["name"] == "compute" for v in vs)
    extra = (warmup * has_compute + (2 * warmup + steps) * n_diloco) if n_diloco else 0
    bar = Progress((warmup + steps) * len(vs) + extra, enabled=comm.get_rank() == 0)
    xs = [torch.randn(batch, WIDTH, generator=gen).to(device) for _ in range(warmup + steps)]

    def one_step(v: dict[str, Any], i: int, rewarm: bool = False, bare: bool = False) -> None:
        """Step ``i`` of variant ``v``, recorded unless ``i < warmup``; ``rewarm``: a
        warm-up step that is not even kept in ``steps_ms``; ``bare``: a DiLoCo variant's
        model and optimizer stepped without ``DiLoCo.step()``, recorded as its own
        compute-only (see the solo phase below)."""
        bar.advance(f"{v['name']} {'re-warm' if rewarm else 'step'} {i + 1}/{warmup + steps}")
        p0 = time.process_time()  # every thread of this rank, the step's barrier included
        comm.barrier()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        c0 = time.thread_time()
        v["opt"].zero_grad()
        v["forward"](xs[i]).pow(2).mean().backward()
        t_bwd = time.perf_counter()
        if v["sched"] is not None:
            v["sched"].synchronize()
        t_sync = time.perf_counter()
        stats = v["sched"].statistics() if v["sched"] is not None else None
        if stats is not None:
            worker[v["name"]].append(stats["worker_cpu_s"])
        v["opt"].step()
        t_sync_in = time.perf_counter()
        waited = 0.0
        if v["diloco"] is not None and not bare:
            w0 = v["diloco"].wait_s
            v["diloco"].step()
            waited = v["diloco"].wait_s - w0
        t_sync_out = time.perf_counter()
        if cuda:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        r = rec[v["name"]]
        if rewarm:
            r["rewarm"].append(t1 - t0)
            return
        if bare:
            if i >= warmup:
                r["own"].append(t1 - t0)
            return
        r["all"].append(t1 - t0)
        if i < warmup:
            return
        r["step"].append(t1 - t0)
        r["backward"].append(t_bwd - t0)
        r["cpu"].append(time.thread_time() - c0)
        r["proc"].append(time.process_time() - p0)
        if v["diloco"] is not None:  # DiLoCo.step(): all of it, and its wait for landings
            r["sync"].append(t_sync_out - t_sync_in)
            r["sync_wait"].append(waited)
        if stats is not None:
            v["timeline"] = stats["timeline"], t0  # the row reports the last step's buckets
            c, h = comm_overlap(stats["timeline"], t0, t_bwd)
            r["comm"].append(c)
            r["hidden"].append(h)
            r["exposed"].append(t_sync - t_bwd)

    # Interleaved step by step, so noise hits the variants alike; DiLoCo variants then run
    # their steps back to back, since their reductions go on in the background across
    # steps and would slow an interleaved neighbour (flattering themselves). Compute-only
    # runs back to back too when they do, so their "x compute" compares like with like
    # (measured: back-to-back steps ran 15% faster than interleaved ones).
    solo_run = any(v["diloco"] is not None for v in vs)

    def solo(v: dict[str, Any]) -> bool:
        return v["diloco"] is not None or (solo_run and v["name"] == "compute")

    # Auto's measuring round runs first, on its own (it is warm-up: not recorded), so the
    # interleaved steps below compare its choice with the others.
    for v in vs:
        comp = v["sched"].compression if v["sched"] is not None else None
        while comp is not None and comp.name == "auto" and comp.choice is None:
            one_step(v, 0)
            rec[v["name"]]["all"].clear()
    for i in range(warmup + steps):
        for v in vs:
            if not solo(v):
                one_step(v, i)
    # The solo phase is compute-only's first half, each DiLoCo variant, then compute-only's
    # second half: this shared machine's speed drifts over minutes (a run measured
    # compute-only 15% slower than the DiLoCo variant after it), and the sandwich puts
    # compute-only on both sides of them.
    # The halves split the *recorded* steps evenly (the warm-up goes before the first):
    # split over all steps, 8 warm-up steps of 40 put 12 recorded steps before and 20 after,
    # and the median leaned on whichever side the drift favoured (measured: 400 ms steps
    # before, 345 after, median 350).
    n_steps = warmup + steps
    mid = warmup + steps // 2
    halves = [range(0, mid), range(mid, n_steps)]
    plain = [v for v in vs if solo(v) and v["diloco"] is None]
    for v in plain:
        for i in halves[0]:
            one_step(v, i)
    # Each DiLoCo variant is sandwiched the same way between compute-only steps of its own
    # model and optimizer (DiLoCo.step() not called; the re-warm unrecorded): identical
    # models built in one process ran up to 10% apart, whichever instance it was (three
    # models interleaved in blocks, two runs: 1.009x and 1.106x, 0.959x and 1.003x the
    # first's), and DiLoCo variants that never synced read 1.106-1.109x the compute
    # variant in a run of the full set (thirty-sixth session). ``own_compute_ms`` is the
    # reference free of that: the same tensors, with and without DiLoCo.
    for v in vs:
        if v["diloco"] is not None:
            for i in halves[0]:
                one_step(v, i, bare=True)
            for i in range(n_steps):
                one_step(v, i)
            v["diloco"].flush()
            for i in range(warmup):
                one_step(v, i, bare=True)  # i < warmup: unrecorded
            for i in halves[1]:
                one_step(v, i, bare=True)
    # Compute-only's second half starts with the warm-up steps again, unrecorded, as each
    # DiLoCo variant's run does: its model and data went cold while they ran, and its first
    # recorded steps after them were its slowest (1.35-1.65x its median in two runs where
    # the DiLoCo variants, syncing never, had their slowest at 0.98-1.07x), which made
    # compute-only's own slowest step read as this machine's noise (thirty-sixth session).
    for v in plain:
        for i in range(warmup):
            one_step(v, i, rewarm=True)
        for i in halves[1]:
            one_step(v, i)
    bar.close()
    rows = []
    fp32 = 2 * (w - 1) / w * nparams * 4
    sent = {
        "ddp": fp32,
        "ddp-adamw": fp32,
        "overlap-onebitadam": compressed_bytes(nparams, w),
        "onebitadam-serial": compressed_bytes(nparams, w),
        "ddp-fp16": fp32 / 2,
        "overlap-none": fp32,
        "overlap-fp16": fp32 / 2,
        "overlap-onebit": compressed_bytes(nparams, w),
        "overlap-onebit-flat": compressed_bytes(nparams, w),
        "compute": 0.0,
    }
    for v in vs:
        if v["diloco"] is not None:  # its syncs, once per sync_every steps
            sent[v["name"]] = v["diloco"].steady_bytes_per_step()
    # 90% bootstrap intervals of the ratios the table shows (harness.ratio_interval),
    # paired by step where both variants ran interleaved, step by step
    named = {v["name"]: v for v in vs}

    def interval(top: str, bottom: str) -> list[float]:
        both = not solo(named[top]) and not solo(named[bottom])
        return list(ratio_interval(rec[top]["step"], rec[bottom]["step"], paired=both))

    for v in vs:
        n = v["name"]
        r = rec[n]
        row: dict[str, Any] = {
            "variant": n,
            "params": nparams,
            "world": w,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "batch": batch,
            "heap_pinned": all(k in os.environ for k in PIN_HEAP_ENV),  # --pin-heap
            "threads": threads,  # --threads
            "step_ms": median(r["step"]) * 1e3,
            "bytes_per_rank": sent.get(n),
            "steps_ms": [round(t * 1e3, 1) for t in r["all"]],
            "max_step_ms": max(r["step"]) * 1e3,
            # compute-only's unrecorded warm-up steps before its second half (solo phase)
            "rewarm_steps": len(r["rewarm"]),
            # forward + backward, and the training thread's CPU over the whole step
            "backward_ms": median(r["backward"]) * 1e3,
            "train_cpu_ms": median(r["cpu"]) * 1e3,
            # the whole rank's CPU over the step and its barrier (driver, gloo's threads):
            # less train_cpu_ms, what runs beside the training thread and competes with it
            # for a core (a DiLoCo sync's reduction, a scheduler's worker)
            "rank_cpu_ms": median(r["proc"]) * 1e3,
        }
        ddp = "ddp-adamw" if "adam" in n and "ddp-adamw" in named else "ddp"
        if ddp in named and n != ddp:
            row["vs_ddp_90"] = interval(ddp, n)  # DDP's step over this one's: a speed-up
        if "compute" in named and n != "compute":
            row["x_compute_90"] = interval(n, "compute")
        if v["sched"] is not None:
            cpu = worker[n][-steps - 1 :]  # the measured steps, from the warm-up's last
            row["worker_cpu_ms"] = (cpu[-1] - cpu[0]) / max(len(cpu) - 1, 1) * 1e3
            tl, t0 = v["timeline"]  # the last step's buckets, in ms from the step's start
            row["buckets_ms"] = [
                [e["bucket"], *(round((e[k] - t0) * 1e3, 1) for k in ("ready", "start", "end"))]
                for e in tl
            ]
        # +1: the scheduler rebuilds its buckets after step 0, which resets the compressor's
        # per-bucket state, so its warm-up counts again from step 1
        first = COMPRESS_FROM + 1
        if n in ("overlap-onebit", "overlap-powersgd") and len(r["all"]) > first:
            row["first_compressed_ms"] = r["all"][first] * 1e3
        if "onebitadam" in n and len(r["all"]) > COMPRESS_FROM:  # frozen from this step
            row["first_compressed_ms"] = r["all"][COMPRESS_FROM] * 1e3
        if v["diloco"] is not None:
            row["fragments"] = v["diloco"].fragments
            row["sync_every"], row["delay"] = v["diloco"].sync_every, v["diloco"].delay
            # its own model and optimizer stepped without DiLoCo (the solo phase): the
            # compute-only reference with no difference of tensors (median, slowest)
            row["own_compute_ms"] = median(r["own"]) * 1e3
            row["x_own_compute_90"] = list(ratio_interval(r["step"], r["own"], paired=False))
            row["own_compute_max_ms"] = max(r["own"]) * 1e3
            # what DiLoCo.step() took of a step (median, slowest), and of that the wait for
            # reductions at landings: the rest of a step's excess over compute-only is
            # interference (the driver's and gloo's threads, memory bandwidth)
            row["diloco_step_ms"] = median(r["sync"]) * 1e3
            row["diloco_step_max_ms"] = max(r["sync"]) * 1e3
            row["diloco_steps_ms"] = [x * 1e3 for x in r["sync"]]  # each recorded step's
            row["diloco_wait_ms"] = median(r["sync_wait"]) * 1e3
            row["diloco_wait_max_ms"] = max(r["sync_wait"]) * 1e3
            # whether the pseudo-gradient passes ran on their own thread, and the inner
            # optimizer's wait for them (mean per step, the whole run)
            row["diloco_pass_thread"] = v["diloco"].pass_thread
            row["diloco_background"] = v["diloco"].background
            stats = v["diloco"].statistics()
            row["diloco_late"] = stats["late"]  # its landings kept waiting: H does not fit
            row["diloco_pass_wait_ms"] = stats["pass_wait_s"] * 1e3 / max(1, stats["inner_steps"])
        if v["sched"] is not None:
            row["hierarchical"] = v["sched"].hierarchical
            if row["hierarchical"] and row["bytes_per_rank"]:  # what crosses between hosts
                h = v["sched"].compression
                row["bytes_per_rank"] = compressed_bytes(-(-nparams // h.local), h.hosts)
        if v["sched"] is not None and v["sched"].compression.name == "auto":
            row["choice"] = v["sched"].compression.choice
            row["bytes_per_rank"] = sent.get(f"overlap-{row['choice']}")
            row["auto_costs_ms"] = v["sched"].compression.statistics()["costs_ms"]
        if r["comm"]:
            total, hidden = median(r["comm"]), median(r["hidden"])
            row.update(
                comm_ms=total * 1e3,
                hidden_ms=hidden * 1e3,
                exposed_ms=median(r["exposed"]) * 1e3,
                overlap_ratio=(hidden / total) if total else 0.0,
            )
        rows.append(row)
        if v["sched"] is not None:
            v["sched"].remove()
        if v["diloco"] is not None:
            v["diloco"].remove()
    return rows


def plot_steps(rows: list[dict[str, Any]], out: str, link: str) -> str:
    """Each variant's step time against the step number, to a PNG (DiLoCo's stalls at its
    syncs show as spikes, streaming's as their absence)."""
    from overlap.pictures import pyplot, save

    fig, ax = pyplot().subplots(figsize=(8, 4.5))
    for r in rows:
        ax.plot(range(1, len(r["steps_ms"]) + 1), r["steps_ms"], marker=".", label=r["variant"])
    ax.set_xlabel("step")
    ax.set_ylabel("step time (ms, rank 0)")
    ax.set_yscale("log")
    ax.set_title(f"{rows[0]['params'] / 1e6:.1f}M-param MLP, {rows[0]['world']} ranks, link {link}")
    ax.legend()
    fig.tight_layout()
    return save(fig, out)


def main_train(argv: list[str] | None = None) -> None:
    """``python -m overlap.bench.train VARIANTS STEPS WARMUP MILLION WORLD [BATCH DEVICE]``:
    prints RESULT."""
    import json
    import sys

    from overlap.testing import RankPool

    a = sys.argv[1:] if argv is None else argv
    batch = int(a[5]) if len(a) > 5 else 64
    device = a[6] if len(a) > 6 else "cpu"
    backend = "nccl" if device == "cuda" else "gloo"
    if a[4] == "env":  # started by a launcher (torchrun across hosts): this process is a rank
        from overlap import comm, init_distributed

        init_distributed(backend, timeout=7200)
        rows = bench_train_rank(a[0].split(","), int(a[1]), int(a[2]), float(a[3]), batch, device)
        if comm.get_rank() == 0:
            sys.stdout.write("RESULT " + json.dumps(rows) + "\n")
            sys.stdout.flush()
        comm.destroy_process_group()
        return
    with RankPool(int(a[4]), backend=backend, timeout=7200) as pool:
        rows = pool.run(
            bench_train_rank,
            a[0].split(","),
            int(a[1]),
            int(a[2]),
            float(a[3]),
            batch,
            device,
            timeout=7200,
        )[0]
    sys.stdout.write("RESULT " + json.dumps(rows) + "\n")


if __name__ == "__main__":  # run by the CLI as stopping.python_module(__name__, ...)
    from overlap.bench.stopping import terminate_as_exit

    with terminate_as_exit():  # kill: its ranks and folders are cleaned up
        main_train()
