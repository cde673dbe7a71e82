"""What the BucketScheduler costs the host per step, against DDP and compute alone.

One gloo rank (no peer, so no wire), a model whose compute is small (six ``Linear(W, W)`` +
``Tanh`` layers, batch 32) and one bucket per layer, so what is measured is the Python and
the torch calls around the reduction: the gradient hooks, the bucket launches and the end of
step (the used-parameter vote, the copy back). That cost is the same on a GPU, where it
adds to a short step (docs/benchmarks.md, "GPU"). The three ways are interleaved step by
step; medians in microseconds after a warm-up.

Usage: python scripts/sched_host_cost.py [--width 64] [--steps 600] [--warmup 100]
Run a checkout's copy with ``PYTHONPATH=<checkout>`` to compare two commits side by side.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--port", type=int, default=29533)
    args = ap.parse_args(argv)

    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from overlap import BucketScheduler, comm
    from overlap.compression import NoCompression

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    comm.init_distributed(dist_backend="gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    w = args.width

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(w, w), nn.Tanh()) for _ in range(6)])

    x = torch.randn(32, w)
    models = {"compute": model(), "ddp": DistributedDataParallel(model()), "overlap": model()}
    cap = 2 * w * w * 4 / 2**20  # one layer (weight and bias) per bucket
    sched = BucketScheduler(
        models["overlap"], compression=NoCompression(), bucket_cap_mb=cap, first_bucket_mb=cap
    )
    times: dict[str, list[float]] = {k: [] for k in models}
    for i in range(args.warmup + args.steps):
        for name, m in models.items():
            t0 = time.perf_counter()
            for p in m.parameters():
                p.grad = None
            m(x).pow(2).mean().backward()
            if name == "overlap":
                sched.synchronize()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    sys.stdout.write(
        f"buckets {len(sched.buckets)}; median step us: "
        + ", ".join(f"{k} {v:.1f}" for k, v in med.items())
        + f"; overlap - ddp {med['overlap'] - med['ddp']:.1f} us, "
        f"overlap / ddp {med['overlap'] / med['ddp']:.2f}x\n"
    )
    comm.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
