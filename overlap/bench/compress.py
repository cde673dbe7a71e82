"""``overlap bench compress``: the cost of 1-bit compression, and what it saves on a link.

Part 1 (one process): for N floats, the OneBit worker side (error add, scale, error update,
sign packing) and the decompression (unpack and scale), each against a memory-bound
reference measured in the same run: one read pass over the buffer (``torch.sum``).

Part 2 (2 ranks, optionally inside a shaped link): ``compressed_allreduce`` against a plain
fp32 ``all_reduce`` of the same buffer, interleaved in one run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from overlap.bench.harness import median
from overlap.compression import fused
from overlap.compression.onebit import _minus_signed
from overlap.compression.packbits import pack_signs, sign_table

__all__ = ["bench_codec", "bench_link_rank", "worker_side"]


def worker_side(x: torch.Tensor, e: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The OneBit worker step as compressed_allreduce runs it (b is a P-float scratch)."""
    torch.add(x, e, out=b)
    scale = torch.linalg.vector_norm(b) / math.sqrt(b.numel())
    if b.device.type == "cpu" and fused.available():
        packed = torch.empty(b.numel() // 8, dtype=torch.uint8)
        fused.pack_signs_np(b.numpy(), packed.numpy())
        fused.error_update(b.numpy(), float(scale), e.numpy())
        return packed
    packed = pack_signs(b)
    _minus_signed(b, scale, e)
    return packed


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
    x = torch.randn(n, device=dev)
    e = torch.zeros(n, device=dev)
    b = torch.empty(n, device=dev)
    packed = pack_signs(x)
    table = sign_table(dev)
    read = _time(lambda: x.sum(), reps, sync)
    work = _time(lambda: worker_side(x, e, b), reps, sync)
    pack = _time(lambda: pack_signs(x), reps, sync)
    unpack = _time(lambda: table[packed.long()].reshape(-1).mul_(0.5), reps, sync)
    gb = n * 4 / 1e9
    return {
        "floats": n,
        "device": str(dev),
        "read_ms": read * 1e3,
        "worker_ms": work * 1e3,
        "pack_ms": pack * 1e3,
        "unpack_ms": unpack * 1e3,
        "worker/read": work / read,
        "pack/read": pack / read,
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
        x = buf.clone()
        comm.barrier()
        t0 = time.perf_counter()
        comm.all_reduce(x)
        t1 = time.perf_counter()
        comm.barrier()
        t2 = time.perf_counter()
        compressed_allreduce(buf.clone(), we, se)
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


if __name__ == "__main__":
    main_link()
