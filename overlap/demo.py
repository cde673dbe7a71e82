"""``overlap demo``: watch overlap hide (compressed) gradient reduction behind backward.

The ranks are started by torch.distributed's own launcher API (``elastic_launch``, the
engine behind torchrun); the command line runs them inside a network namespace shaped to
1 Gbit/s when it can (root), else on plain loopback, and says which. Each rank trains the
same small transformer on synthetic tokens, every variant in turn step by step so the
machine's noise hits all alike:

* compute only (no communication: the floor), DDP and DDP with its fp16 hook (the
  baselines);
* overlap's BucketScheduler with no compression, fp16, 1-bit (OneBit), and ``"auto"``,
  which measures those and PowerSGD first (on its own, before the timed steps) and keeps
  the fastest.

It reports each variant's median step time, exposed communication, overlap ratio and bytes
per rank. Rank 0 writes the trace of overlap-auto's steps and of one DDP step
(``overlap-trace.json``: https://ui.perfetto.dev or chrome://tracing), a timeline of one
steady-state step of each on one time scale (``overlap-timeline.png``), and the step times
as bars over the compute-only floor (``overlap-steps.png``).
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import time
import uuid
from typing import Any

import torch
from torch import nn

from overlap.bench.harness import Progress
from overlap.bench.stopping import interrupt_once

__all__ = ["TinyTransformer", "demo_rank", "run_demo"]

log = logging.getLogger(__name__)
VARIANTS = [
    "compute",
    "ddp",
    "ddp-fp16",
    "overlap-none",
    "overlap-fp16",
    "overlap-onebit",
    "overlap-auto",
]
BATCH = (8, 32)  # sequences x tokens: a small batch, so the wire matters next to compute
TRACED = "overlap-auto"  # the variant whose steps are traced (and drawn against DDP)


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


def _ddp_trace_hook(state: dict[str, Any], bucket: Any) -> Any:
    """DDP's allreduce-and-average, recording each bucket's collective (for the picture
    only: the timed DDP variants use DDP's built-in C++ allreduce)."""
    import torch.distributed as dist

    t = time.perf_counter_ns()
    state["last_hook"] = t
    idx, tracer = bucket.index(), state["tracer"]
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()

    def done(f: Any) -> torch.Tensor:
        tracer.record(f"allreduce bucket {idx}", "comm", t, time.perf_counter_ns(), bucket=idx)
        out: torch.Tensor = f.value()[0].div_(state["world"])
        return out

    return fut.then(done)


def _build(name: str, cfg: dict[str, int], tracer: Any) -> dict[str, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from overlap import Auto, BucketScheduler, comm
    from overlap.compression import FP16, NoCompression, OneBit

    torch.manual_seed(0)
    model = TinyTransformer(dim=cfg["dim"], layers=cfg["layers"])
    v: dict[str, Any] = {"name": name, "model": model, "sched": None, "fwd": model, "hook": None}
    v.update(times=[], exposed=[], hidden=[], comm=[])
    if name.startswith("ddp"):
        v["fwd"] = DDP(model)
        if name == "ddp-fp16":
            v["fwd"].register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif name == "ddp-traced":
            v["hook"] = {"tracer": tracer, "world": comm.get_world_size(), "last_hook": 0}
            # a lambda: DDP checks a hook's annotations, and ours are strings here
            v["fwd"].register_comm_hook(
                v["hook"], lambda state, bucket: _ddp_trace_hook(state, bucket)
            )
    elif name.startswith("overlap"):
        comp = {
            "overlap-none": NoCompression(),
            "overlap-fp16": FP16(),
            "overlap-onebit": OneBit(warmup_steps=3),
            "overlap-auto": Auto(),
        }[name]
        v["sched"] = BucketScheduler(
            model,
            compression=comp,
            tracer=tracer if name == TRACED else None,
        )
    v["opt"] = torch.optim.AdamW(model.parameters(), lr=3e-4)
    return v


def _one_step(
    v: dict[str, Any], tokens: torch.Tensor, target: torch.Tensor, tracer: Any, trace: bool
) -> None:
    from overlap import comm

    comm.barrier()
    if trace:
        tracer.attach()
    t0 = time.perf_counter_ns()
    v["opt"].zero_grad()
    logits = v["fwd"](tokens)
    t_fwd = time.perf_counter_ns()
    loss = nn.functional.cross_entropy(logits.reshape(-1, 512), target.reshape(-1))
    loss.backward()  # type: ignore[no-untyped-call]
    t_bwd = time.perf_counter_ns()
    if v["sched"] is not None:
        v["sched"].synchronize()
    t_sync = time.perf_counter_ns()
    v["opt"].step()
    t1 = time.perf_counter_ns()
    if trace:
        tracer.record("forward", "compute", t0, t_fwd)
        if v["hook"] is not None:  # DDP: backward until its last bucket, then the wait
            last = max(v["hook"]["last_hook"], t_fwd)
            tracer.record("backward", "compute", t_fwd, last)
            tracer.record("DDP's wait in backward", "wait", last, t_bwd)
        tracer.record("optimizer", "compute", t_sync, t1)
        tracer.record("demo step", "user", t0, t1, variant=v["name"])
        tracer.detach()
    v["times"].append((t1 - t0) / 1e9)
    v["loss"] = loss.item()
    if v["sched"] is not None:
        from overlap.bench.train import comm_overlap

        c, h = comm_overlap(v["sched"].statistics()["timeline"], t0 / 1e9, t_bwd / 1e9)
        v["comm"].append(c)
        v["hidden"].append(h)
        v["exposed"].append((t_sync - t_bwd) / 1e9)


@interrupt_once  # a rank stopped by Ctrl-C says nothing more
def demo_rank(steps: int, model_size: str, out_dir: str, link: str) -> dict[str, Any]:
    """One rank of the demo: its row of results (rank 0's holds the table)."""
    import overlap
    from overlap import comm
    from overlap.bench.guard import exit_with_parent
    from overlap.compression import compressed_bytes

    exit_with_parent()  # the launcher is the demo's own process: end with it, even by SIGKILL

    torch.set_num_threads(1)
    overlap.init_distributed()
    rank, world = comm.get_rank(), comm.get_world_size()
    cfg = _size(model_size)
    tracer = overlap.Tracer()
    runs = {n: _build(n, cfg, tracer) for n in [*VARIANTS, "ddp-traced"]}
    tracer.detach()  # the scheduler attached it; attach only around the traced steps
    nparams = sum(p.numel() for p in runs["ddp"]["model"].parameters())
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 512, BATCH, generator=gen) for _ in range(4)]
    auto = runs["overlap-auto"]["sched"].compression
    trial = 0
    while auto.choice is None:  # Auto's measuring round, on its own, before the timed steps
        tokens = batches[trial % len(batches)]
        _one_step(runs["overlap-auto"], tokens, torch.roll(tokens, -1, dims=1), tracer, False)
        trial += 1
    runs["overlap-auto"]["times"].clear()
    progress = Progress(
        steps * len(VARIANTS), rank == 0, label="training", transient=False, stderr=False
    )
    for step in range(steps + 1):
        tokens = batches[step % len(batches)]
        target = torch.roll(tokens, -1, dims=1)
        for name, v in runs.items():
            if name == "ddp-traced" and step < steps - 1:
                continue  # only for the picture: a warm-up step, then the traced one
            _one_step(v, tokens, target, tracer, step == steps and name in ("ddp-traced", TRACED))
            if step == 0:
                v["times"].clear()  # warm-up
                v["comm"].clear()
                v["hidden"].clear()
                v["exposed"].clear()
            elif name != "ddp-traced":
                progress.advance(f"{name} step {step}/{steps}")
    progress.close()
    trace_path = os.path.join(out_dir, "overlap-trace.json")
    written = tracer.export_chrome(trace_path)  # every rank calls; rank 0 writes
    med = _median
    fp32 = 2 * (world - 1) / world * nparams * 4
    sent = {
        "compute": 0.0,
        "ddp": fp32,
        "ddp-fp16": fp32 / 2,
        "overlap-none": fp32,
        "overlap-fp16": fp32 / 2,
        "overlap-onebit": compressed_bytes(nparams, world),
    }
    sent["overlap-auto"] = sent.get(f"overlap-{auto.choice}", fp32)
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
        if n != "ddp-traced"
    }
    pngs: list[str] = []
    if written:
        pngs = _pictures(written, table, out_dir, auto.choice, link, f"{nparams / 1e6:.2f}M params")
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
        "auto": auto.statistics(),
        "link": link,
        "trace": written,
        "png": pngs,
    }


def _pictures(
    trace: str, table: dict[str, Any], out_dir: str, choice: str, link: str, what: str
) -> list[str]:
    """The timeline (one DDP step over one overlap-auto step, one time scale) and the step
    time bars; [] without matplotlib."""
    try:
        from overlap.trace.plot import plot_compare, plot_step_bars
    except ImportError:  # pragma: no cover - plot is a default dependency
        return []
    from overlap.trace.report import spans_by_rank

    spans = _load(trace)
    panels = []
    for variant, label in (("ddp-traced", "DDP"), (TRACED, f"overlap auto ({choice})")):
        sel: list[Any] = []
        for _, mine in sorted(spans_by_rank(spans).items()):
            wins = [s for s in mine if s[0] == "demo step" and s[5].get("variant") == variant]
            if wins:
                lo, hi = wins[-1][2], wins[-1][3]
                sel += [s for s in mine if lo <= s[2] < hi and s[0] != "demo step"]
        panels.append((label, sel))
    try:
        out = [
            plot_compare(
                panels,
                os.path.join(out_dir, "overlap-timeline.png"),
                title=f"one steady-state step each, {what}, link {link}",
            ),
            plot_step_bars(
                [(n, r["step_ms"]) for n, r in table.items() if n != "compute"],
                os.path.join(out_dir, "overlap-steps.png"),
                floor_ms=table["compute"]["step_ms"],
                title=f"median step time, {what}, link {link}",
            ),
        ]
    except (ImportError, ValueError) as exc:
        log.warning("no pictures: %s", exc)
        return []
    return out


def _load(path: str) -> list[Any]:
    from overlap.trace import load_spans

    return load_spans(path)[0]


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run_demo(
    world_size: int = 2,
    steps: int = 10,
    model_size: str = "medium",
    out_dir: str = ".",
    link: str = "loopback",
) -> dict[int, dict[str, Any]]:
    """Launch ``world_size`` local ranks with torch's elastic launcher; return their results.

    Each rank is a process of its own, ``python -m overlap.demo ...`` (as
    :func:`overlap.bench.stopping.python_module` runs it), which writes its result to a file
    here. Why not a Python function as the launcher's entrypoint (as before the
    fifty-seventh session): the launcher starts those with multiprocessing in the
    terminal's process group, so a Ctrl-C reached each rank from the terminal and again
    from the launcher (the second landed in the rank's exit and aborted it), and a rank
    still importing torch printed its KeyboardInterrupt's traceback. A command runs in a
    session of its own: only the launcher passes the Ctrl-C on, once."""
    from torch.distributed.launcher.api import elastic_launch

    from overlap.bench.guard import Guardian
    from overlap.bench.stopping import python_module

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # the launcher's per-rank error files go to a directory of ours, removed afterwards:
    # left to itself it makes a /tmp/torchelastic_* directory per run and never removes it
    guard = Guardian()  # removes it should this process be killed by SIGKILL
    with tempfile.TemporaryDirectory(prefix="overlap-demo-") as log_dir:
        guard.folder(log_dir)
        config = _launch_config(
            log_dir,
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=world_size,
            run_id=uuid.uuid4().hex[:8],
            rdzv_backend="c10d",
            rdzv_endpoint=f"127.0.0.1:{_free_port()}",
            max_restarts=0,
            monitor_interval=0.2,
        )
        results_at = os.path.join(log_dir, "result")
        cmd = python_module(
            __name__, str(steps), model_size, os.path.abspath(out_dir), link, results_at
        )
        try:
            elastic_launch(config, cmd[0])(*cmd[1:])
            results = {r: _read_result(f"{results_at}.{r}") for r in range(world_size)}
        finally:
            guard.release()
    return results


def _read_result(path: str) -> dict[str, Any]:
    import json

    with open(path) as f:
        out: dict[str, Any] = json.load(f)
    return out


def main_rank(argv: list[str] | None = None) -> None:
    """``python -m overlap.demo STEPS MODEL_SIZE OUT_DIR LINK RESULTS``: one rank under
    the launcher (:func:`run_demo`); its result goes to ``RESULTS.<rank>`` (written whole,
    then renamed into place)."""
    import json
    import sys

    a = sys.argv[1:] if argv is None else argv
    try:
        out = demo_rank(int(a[0]), a[1], a[2], a[3])
    except KeyboardInterrupt:
        # The launcher passed a Ctrl-C on and is stopping the job. Exit now, without the
        # interpreter's shutdown: a gloo op still in flight (DDP's fp16 hook and the trace
        # hook here finish theirs in Python callbacks) that ends during it takes the GIL
        # from gloo's thread, and the rank died with "terminate called without an active
        # exception" (fifty-seventh session, about 1 Ctrl-C in 6 during training).
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(130)
    path = f"{a[4]}.{out['rank']}"
    with open(path + ".part", "w") as f:
        json.dump(out, f)
    os.replace(path + ".part", path)


def _launch_config(log_dir: str, **fields: Any) -> Any:
    """torch's LaunchConfig writing its logs under ``log_dir``: torch >= 2.3 takes a
    ``logs_specs``, torch 2.2 a ``log_dir`` field."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    if "logs_specs" in {f.name for f in dataclasses.fields(LaunchConfig)}:
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

        fields["logs_specs"] = DefaultLogsSpecs(log_dir=log_dir)
    else:  # torch 2.2
        fields["log_dir"] = log_dir
    return LaunchConfig(**fields)


if __name__ == "__main__":  # a rank, as run_demo starts it
    main_rank()
