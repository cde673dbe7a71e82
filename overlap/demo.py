"""``overlap demo``: watch awaitable communication hide behind computation, on local ranks.

The ranks are started by torch.distributed's own launcher API (``elastic_launch``, the engine
behind torchrun). Each rank runs the same toy "backward" twice per step, over a stack of
layers whose gradients must be averaged across ranks:

* serial: compute every layer's gradient, then all_reduce them one by one (blocking);
* overlapped: issue each layer's all_reduce with ``async_op=True`` as soon as its gradient
  exists, keep computing the next layer, and ``await`` everything at the end.

Both must produce bitwise-identical averaged gradients (checked every step); the difference
in step time is communication that the event loop hid behind compute.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from typing import Any

import torch

__all__ = ["demo_rank", "run_demo"]

log = logging.getLogger(__name__)


def _layer_grads(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    grads = []
    for w in weights:
        x = torch.tanh(x @ w)
        grads.append((x.T @ x) / x.shape[0])  # a stand-in gradient, dim x dim
    return grads


def demo_rank(steps: int, dim: int, layers: int) -> dict[str, Any]:
    """One rank of the demo (module level so the launcher can pickle it)."""
    import overlap
    from overlap import comm

    torch.set_num_threads(1)
    overlap.init_distributed()
    rank, world = comm.get_rank(), comm.get_world_size()
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(dim, dim, generator=gen) / dim**0.5 for _ in range(layers)]
    data_gen = torch.Generator().manual_seed(1000 + rank)

    def serial(x: torch.Tensor) -> list[torch.Tensor]:
        grads = _layer_grads(x, weights)
        for g in grads:
            comm.all_reduce(g, op="avg")
        return grads

    async def overlapped(x: torch.Tensor) -> list[torch.Tensor]:
        handles = []
        for w in weights:
            x = torch.tanh(x @ w)
            g = (x.T @ x) / x.shape[0]
            handles.append(comm.all_reduce(g, op="avg", async_op=True))
            await asyncio.sleep(0)  # let finished ops complete while we compute
        return list(await asyncio.gather(*handles))

    import asyncio

    async def main() -> dict[str, Any]:
        t_serial, t_overlap, nbytes = [], [], 0
        for step in range(steps + 1):
            x = torch.randn(256, dim, generator=data_gen)
            comm.barrier()
            t0 = time.perf_counter()
            a = serial(x)
            t1 = time.perf_counter()
            comm.barrier()
            t2 = time.perf_counter()
            b = await overlapped(x)
            t3 = time.perf_counter()
            if not all(torch.equal(p, q) for p, q in zip(a, b, strict=True)):
                raise AssertionError("overlapped and serial gradients differ")
            if step == 0:
                continue  # warm-up
            t_serial.append(t1 - t0)
            t_overlap.append(t3 - t2)
            nbytes += sum(g.numel() * g.element_size() for g in b)
            if rank == 0:
                log.info(
                    "step %d/%d: serial %.1f ms, overlapped %.1f ms",
                    step,
                    steps,
                    (t1 - t0) * 1e3,
                    (t3 - t2) * 1e3,
                )
        return {
            "rank": rank,
            "world": world,
            "serial_s": t_serial,
            "overlap_s": t_overlap,
            "bytes": nbytes,
        }

    try:
        return overlap.run(main())
    finally:
        comm.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run_demo(
    world_size: int = 2, steps: int = 20, dim: int = 512, layers: int = 6
) -> dict[int, dict[str, Any]]:
    """Launch ``world_size`` local ranks with torch's elastic launcher; return their results."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=uuid.uuid4().hex[:8],
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        max_restarts=0,
        monitor_interval=0.2,
        start_method="spawn",
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results: dict[int, dict[str, Any]] = elastic_launch(config, demo_rank)(steps, dim, layers)
    return results
