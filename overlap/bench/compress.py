"""``overlap bench compress``: the cost of 1-bit compression, and what it saves on a link.

Part 1 (one process): for N floats, each stage of the codec that compressed_allreduce and
OneBit run (:mod:`overlap.compression.codec`, the default codec for the device), against a
memory-bound reference measured in the same run: one read pass over the buffer
(``torch.sum``, with torch's threads; the codec uses as many):

* worker: error add, scales, sign packing and the (lazy) error update: ``encode``;
* server + rebuild: this rank's chunk of a 2-rank job (``server``), then the rebuild of the
  whole buffer from the gathered signs;
* unpack: the rebuild alone.

Part 2 (2 ranks, optionally inside a shaped link): ``compressed_allreduce`` against a plain
fp32 ``all_reduce`` of the same buffer, interleaved in one run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from overlap.bench.harness import median
from overlap.compression.codec import ErrorFeedback, codec_for
from overlap.compression.layout import Layout

__all__ = ["bench_codec", "bench_link_rank"]


def _time(fn: Callable[[], Any], reps: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return median(ts)


def _codec_row(n: int, reps: int, dev: torch.device, sync: Callable[[], None]) -> dict[str, Any]:
    codec = codec_for(dev)
    lay = Layout(n, 2, 0, None)
    ef = ErrorFeedback.zeros(lay, dev)
    x = torch.randn(n, device=dev)
    out = torch.empty(n, device=dev)
    recv = torch.randint(0, 256, (2, lay.chunk // 8), dtype=torch.uint8, device=dev)
    q = torch.full((2, 1), 0.25, device=dev)
    signs = torch.randint(0, 256, (lay.P // 8,), dtype=torch.uint8, device=dev)
    sscales = torch.full((2, 1), 0.5, device=dev)

    def worker() -> None:
        _, scale, b = codec.encode(x, lay, ef)
        ef.commit_worker(b, scale.to(dev))

    def server_rebuild() -> None:
        codec.server(recv, q, lay, ef)
        codec.rebuild(signs, sscales, lay, out)

    read = _time(lambda: x.sum(), reps, sync)
    work = _time(worker, reps, sync)
    srv = _time(server_rebuild, reps, sync)
    unpack = _time(lambda: codec.rebuild(signs, sscales, lay, out), reps, sync)
    gb = n * 4 / 1e9
    return {
        "floats": n,
        "device": str(dev),
        "codec": codec.name,
        "threads": torch.get_num_threads(),
        "read_ms": read * 1e3,
        "worker_ms": work * 1e3,
        "server_rebuild_ms": srv * 1e3,
        "unpack_ms": unpack * 1e3,
        "worker/read": work / read,
        "server+rebuild/read": srv / read,
        "unpack/read": unpack / read,
        "worker_GBps": gb / work,
        "read_GBps": gb / read,
    }


def bench_codec(sizes: list[int], reps: int, device: str = "cpu") -> list[dict[str, Any]]:
    """Part 1: the codec's cost per size, against one read pass measured in the same run."""
    dev = torch.device(device)
    sync: Callable[[], None] = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    return [_codec_row(n, reps, dev, sync) for n in sizes]


def bench_link_rank(nbytes: int, iters: int) -> dict[str, Any]:
    """Runs on each of the ranks: fp32 all_reduce vs compressed_allreduce, interleaved."""
    from overlap import comm
    from overlap.compression import compressed_allreduce, compressed_bytes, padded_numel

    w = comm.get_world_size()
    n = nbytes // 4
    buf = torch.randn(n)
    we, se = torch.zeros(padded_numel(n, w)), torch.zeros(padded_numel(n, w) // w)
    t_plain, t_comp = [], []
    for i in range(iters + 1):
        x, y = buf.clone(), buf.clone()  # copies made outside both timed windows
        comm.barrier()
        t0 = time.perf_counter()
        comm.all_reduce(x)
        t1 = time.perf_counter()
        comm.barrier()
        t2 = time.perf_counter()
        compressed_allreduce(y, we, se)
        t3 = time.perf_counter()
        if i:
            t_plain.append(t1 - t0)
            t_comp.append(t3 - t2)
    plain, comp = median(t_plain), median(t_comp)
    return {
        "bytes": nbytes,
        "world": w,
        "allreduce_ms": plain * 1e3,
        "compressed_ms": comp * 1e3,
        "speedup": plain / comp,
        "fp32_bytes_per_rank": int(2 * (w - 1) / w * nbytes),
        "compressed_bytes_per_rank": compressed_bytes(n, w),
    }


def main_link(argv: list[str] | None = None) -> None:
    """``python -m overlap.bench.compress NBYTES ITERS WORLD``: part 2, prints RESULT json."""
    import json
    import sys

    from overlap.testing import RankPool

    args = sys.argv[1:] if argv is None else argv
    nbytes, iters, world = int(args[0]), int(args[1]), int(args[2])
    with RankPool(world, timeout=3600) as pool:
        res = pool.run(bench_link_rank, nbytes, iters, timeout=3600)[0]
    sys.stdout.write("RESULT " + json.dumps(res) + "\n")


if __name__ == "__main__":  # run by the CLI as stopping.python_module(__name__, ...)
    from overlap.bench.stopping import terminate_as_exit

    with terminate_as_exit():  # kill: its ranks and folders are cleaned up
        main_link()
