"""``overlap demo``: watch overlap hide (compressed) gradient reduction behind backward.

The ranks are started by torch.distributed's own launcher API (``elastic_launch``, the
engine behind torchrun). Each rank trains the same small transformer-like model on
synthetic data, four ways in turn, step by step so the machine's noise hits all alike:

* DDP (torch's DistributedDataParallel, the baseline);
* overlap's BucketScheduler with no compression, with fp16, and with 1-bit (OneBit);

and reports each one's step time, exposed communication, overlap ratio and bytes per rank.
Rank 0 also traces the OneBit run and writes ``overlap-trace.json`` (open it in
https://ui.perfetto.dev or chrome://tracing) and ``overlap-timeline.png``.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from typing import Any

import torch
from torch import nn

__all__ = ["TinyTransformer", "demo_rank", "run_demo"]

log = logging.getLogger(__name__)
VARIANTS = ["ddp", "overlap-none", "overlap-fp16", "overlap-onebit"]


class TinyTransformer(nn.Module):
    """Pre-norm transformer blocks (attention + MLP) over a token embedding."""

    def __init__(self, vocab: int = 512, dim: int = 128, layers: int = 4, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(layers)
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for b in self.blocks:
            h = b(h)
        out: torch.Tensor = self.head(h)
        return out


def _size(model_size: str) -> dict[str, int]:
    return {
        "small": {"dim": 128, "layers": 4},
        "medium": {"dim": 256, "layers": 6},
        "large": {"dim": 384, "layers": 8},
    }[model_size]


def demo_rank(steps: int, model_size: str, out_dir: str) -> dict[str, Any]:
    """One rank of the demo (module level so the launcher can pickle it)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import overlap
    from overlap import BucketScheduler, comm
    from overlap.compression import FP16, NoCompression, OneBit, compressed_bytes

    torch.set_num_threads(1)
    overlap.init_distributed()
    rank, world = comm.get_rank(), comm.get_world_size()
    cfg = _size(model_size)
    tracer = overlap.Tracer()
    runs: dict[str, dict[str, Any]] = {}
    for name in VARIANTS:
        torch.manual_seed(0)
        model = TinyTransformer(dim=cfg["dim"], layers=cfg["layers"])
        v: dict[str, Any] = {
            "model": model,
            "sched": None,
            "times": [],
            "exposed": [],
            "hidden": [],
            "comm": [],
        }
        if name == "ddp":
            v["fwd"] = DDP(model)
        else:
            comp = {
                "overlap-none": NoCompression(),
                "overlap-fp16": FP16(),
                "overlap-onebit": OneBit(warmup_steps=3),
            }[name]
            v["fwd"] = model
            v["sched"] = BucketScheduler(
                model,
                compression=comp,
                bucket_cap_mb=2,
                tracer=tracer if name == "overlap-onebit" else None,
            )
        v["opt"] = torch.optim.AdamW(model.parameters(), lr=3e-4)
        runs[name] = v
    tracer.detach()  # the scheduler attached it; attach only around the OneBit steps
    nparams = sum(p.numel() for p in runs["ddp"]["model"].parameters())
    gen = torch.Generator().manual_seed(rank)
    progress = _Progress(steps * len(VARIANTS)) if rank == 0 else None
    for step in range(steps + 1):
        tokens = torch.randint(0, 512, (16, 64), generator=gen)
        target = torch.roll(tokens, -1, dims=1)
        for name, v in runs.items():
            comm.barrier()
            traced = name == "overlap-onebit"
            if traced:
                tracer.attach()  # record only this variant's ops
            t0 = time.perf_counter()
            v["opt"].zero_grad()
            logits = v["fwd"](tokens)
            loss = nn.functional.cross_entropy(logits.reshape(-1, 512), target.reshape(-1))
            loss.backward()  # type: ignore[no-untyped-call]
            t_bwd = time.perf_counter()
            if v["sched"] is not None:
                v["sched"].synchronize()
            v["opt"].step()
            t1 = time.perf_counter()
            if traced:
                tracer.detach()
            if step == 0:
                continue  # warm-up
            v["times"].append(t1 - t0)
            v["loss"] = loss.item()
            if v["sched"] is not None:
                from overlap.bench.train import comm_overlap

                c, h = comm_overlap(v["sched"].statistics()["timeline"], t0, t_bwd)
                v["comm"].append(c)
                v["hidden"].append(h)
                v["exposed"].append(t1 - t_bwd)
            if progress is not None:
                progress.advance(f"{name} step {step}/{steps}")
    if progress is not None:
        progress.close()
    trace_path = os.path.join(out_dir, "overlap-trace.json")
    written = tracer.export_chrome(trace_path)  # every rank calls; rank 0 writes
    png = None
    if written:
        try:
            from overlap.trace.plot import plot_timeline

            png = plot_timeline(
                list(tracer.spans) if world == 1 else _load(written),
                os.path.join(out_dir, "overlap-timeline.png"),
                title="overlap demo: OneBit, bucket scheduler",
            )
        except ImportError:
            png = None
    fp32 = 2 * (world - 1) / world * nparams * 4
    sent = {
        "ddp": fp32,
        "overlap-none": fp32,
        "overlap-fp16": fp32 / 2,
        "overlap-onebit": compressed_bytes(nparams, world),
    }
    med = _median
    table = {
        n: {
            "step_ms": med(v["times"]) * 1e3,
            "loss": v.get("loss"),
            "bytes": sent[n],
            "comm_ms": med(v["comm"]) * 1e3 if v["comm"] else None,
            "exposed_ms": med(v["exposed"]) * 1e3 if v["exposed"] else None,
            "overlap": (med(v["hidden"]) / med(v["comm"]))
            if v["comm"] and med(v["comm"])
            else None,
        }
        for n, v in runs.items()
    }
    for v in runs.values():
        if v["sched"] is not None:
            v["sched"].remove()
    tracer.detach()
    comm.destroy_process_group()
    return {
        "rank": rank,
        "world": world,
        "params": nparams,
        "table": table,
        "trace": written,
        "png": png,
    }


def _load(path: str) -> list[Any]:
    from overlap.trace import load_spans

    return load_spans(path)[0]


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else 0.0


class _Progress:
    """A rich progress bar on rank 0 (plain log lines when stdout is not a terminal)."""

    def __init__(self, total: int) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.p = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeRemainingColumn(),
        )
        self.task = self.p.add_task("training", total=total)
        self.p.start()

    def advance(self, what: str) -> None:
        self.p.update(self.task, advance=1, description=what)

    def close(self) -> None:
        self.p.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run_demo(
    world_size: int = 2, steps: int = 40, model_size: str = "small", out_dir: str = "."
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
    results: dict[int, dict[str, Any]] = elastic_launch(config, demo_rank)(
        steps, model_size, os.path.abspath(out_dir)
    )
    return results
