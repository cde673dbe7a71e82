"""Where a BucketScheduler step's host time goes, one rank, under torch.profiler.

Written for the lent GPU machine: at one NCCL rank on an H100, overlap-onebit's step took
23.4 ms against DDP's 4.1, and its worker thread used 20 ms of CPU a step while the codec's
GPU time is about 1 ms (docs/benchmarks.md, "GPU", thirty-seventh session). Host-bound: this
says by what. For each variant (none, onebit) it runs the bench's MLP for a few warm-up
steps, then profiles a few steps and prints, per profiled step: the CUDA runtime calls that
block the host (stream, event and device synchronisations, memcpys), the kernel launches,
and the top operators by self CPU time; the worker thread's CPU a step comes from the
scheduler's own statistics. The Chrome trace of the profiled steps goes to
``$OUT/profile-<variant>.json`` (or the current directory), for ui.perfetto.dev.

Usage: python scripts/gpu_onebit_profile.py [--model-size 25.2] [--batch 1024] [--steps 3]
Runs on the CPU too (gloo, one rank; smaller figures), which is how it is checked here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

BLOCKING = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")


def say(line: str) -> None:
    sys.stdout.write(line + "\n")


COUNTED = ("cudaMemcpyAsync", "cudaLaunchKernel", "cudaEventRecord", "cudaStreamWaitEvent")


def _step(model: Any, sched: Any, opt: Any, x: torch.Tensor, cuda: bool) -> float:
    """One training step, device-synchronised at both ends; its milliseconds."""
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    sched.synchronize()
    opt.step()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-size", type=float, default=25.2)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--variant", action="append", choices=["none", "onebit"])
    args = ap.parse_args(argv)
    from torch.profiler import ProfilerActivity, profile

    from overlap import comm
    from overlap.bench.train import WIDTH, _model
    from overlap.compression import NoCompression, OneBit
    from overlap.scheduler import BucketScheduler

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    comm.init_distributed("nccl" if cuda else "gloo", verbose=False)
    out_dir = Path(os.environ.get("OUT", "."))
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    # the worker thread's ops are recorded only with profile_all_threads (a newer torch);
    # CUDA's synchronisations show as events of their own with enable_cuda_sync_events
    try:
        from torch._C._profiler import _ExperimentalConfig

        config = _ExperimentalConfig(profile_all_threads=True, enable_cuda_sync_events=cuda)
    except (ImportError, TypeError):
        config = None
        say("this torch cannot profile every thread: the worker's ops are missing below")
    x = torch.randn(args.batch, WIDTH, device=dev)

    for name in args.variant or ["none", "onebit"]:
        model = _model(args.model_size, dev)
        comp = NoCompression() if name == "none" else OneBit(warmup_steps=0)
        sched = BucketScheduler(model, compression=comp)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        for _ in range(args.warmup):
            _step(model, sched, opt, x, cuda)
        w0 = sched.statistics()["worker_cpu_s"]
        with profile(activities=acts, experimental_config=config) as prof:
            ms = [_step(model, sched, opt, x, cuda) for _ in range(args.steps)]
        worker_ms = (sched.statistics()["worker_cpu_s"] - w0) * 1e3 / args.steps
        buckets = len(sched.buckets)
        sched.remove()
        calls = {e.key: e.count for e in prof.key_averages()}
        say(f"== {name} on {dev}: {buckets} buckets, step {statistics.median(ms):.2f} ms")
        say(f"   worker thread CPU a step: {worker_ms:.2f} ms")
        for k in (*BLOCKING, *COUNTED):
            if k in calls:
                say(f"   {k}: {calls[k] / args.steps:.1f} a step")
        say(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        prof.export_chrome_trace(str(out_dir / f"profile-{name}.json"))
    comm.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
