"""The ``overlap`` command: ``demo``, ``bench ops``, ``env``.

The library itself never prints; this module is the one place that writes to the terminal.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from overlap.bench.agent import quiet_torch_distributed
from overlap.bench.stopping import imports_held, python_module, terminate_as_exit

__all__ = ["main"]


def _out(text: str = "") -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _err(text: str) -> None:
    """An error for the user: to stderr (the caller exits non-zero)."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _run_json(
    cmd: list[str], link: str | None, what: str, env: dict[str, str] | None = None
) -> tuple[Any, int]:
    """Run a benchmark subprocess (in a shaped link if asked); (its RESULT json, 0) or
    (None, exit code) after saying what went wrong."""
    from overlap.bench.guard import with_parent
    from overlap.bench.link import LinkError, shaped_link
    from overlap.bench.stopping import run_child

    cmd = with_parent(cmd)  # it ends with this process, also after a kill -9
    try:
        if link:
            with shaped_link(link) as prefix:
                out, code = run_child(prefix + cmd, env=env, capture=True)
        else:
            out, code = run_child(cmd, env=env, capture=True)  # stderr: live
    except LinkError as exc:
        _err(f"error: {exc}")
        return None, 2
    stdout = out or ""
    result = _result(stdout)
    if result is None:
        _err(f"{what} failed (exit {code}):\n{stdout[-2000:]}")
        return None, 1
    return result, 0


def _result(*outputs: str) -> Any:
    """The JSON after the first ``RESULT `` line of a benchmark's output(s), or None."""
    import json

    line = next((x for o in outputs for x in o.splitlines() if x.startswith("RESULT ")), None)
    return None if line is None else json.loads(line[7:])


def demo_link(asked: str | None) -> tuple[str | None, str]:
    """The demo's link and the reason, in words: ``auto`` is a 1 Gbit/s shaped namespace
    when this process can make one (root, iproute2), else plain loopback."""
    import os
    import shutil

    if asked in (None, "auto"):
        if os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc"):
            return "1gbit", (
                "1 Gbit/s, a typical link between machines (root is available, so the ranks "
                "run in a network namespace whose loopback tc shapes to that rate; --link "
                "none for plain loopback)"
            )
        return None, (
            "plain loopback, faster than any network, so compression cannot pay here (a 1 "
            "Gbit/s link needs root to make a shaped namespace; run as root, or pass --link "
            "RATE as root)"
        )
    if asked in ("none", "loopback"):
        return None, "plain loopback, as asked (--link none)"
    return asked, f"loopback shaped to {asked}, as asked (--link {asked})"


def _verdict(rows: dict[str, Any], choice: str, link: str) -> str:
    """One sentence, computed from the table."""
    auto, ddp, fp16 = (rows[n]["step_ms"] for n in ("overlap-auto", "ddp", "ddp-fp16"))
    floor = rows["compute"]["step_ms"]
    speed, speed16 = ddp / auto, fp16 / auto
    where = f"On this link ({link})"
    tail = f"; its step is {auto / floor:.2f}x the compute-only step."
    if speed >= 1.03 and speed16 >= 1.03:
        return (
            f"{where} overlap-auto (it chose {choice}) is {speed:.2f}x faster than DDP and "
            f"{speed16:.2f}x faster than DDP with its fp16 hook" + tail
        )
    if speed >= 1.03:
        return (
            f"{where} overlap-auto (it chose {choice}) is {speed:.2f}x faster than DDP and on "
            f"a par with DDP's fp16 hook ({speed16:.2f}x)" + tail
        )
    if speed >= 0.95:
        return (
            f"{where} overlap-auto (it chose {choice}) is on a par with DDP ({speed:.2f}x; "
            "differences under 5% are within this machine's step-to-step noise): "
            "communication is cheap here, so compression cannot pay; on a slow link it would."
        )
    return f"{where} overlap-auto (it chose {choice}) is slower than DDP ({speed:.2f}x)."


def cmd_demo(args: argparse.Namespace) -> int:
    import json
    import os

    from overlap.bench.harness import Table, human_bytes

    try:  # before the run, not after a minute of it
        os.makedirs(args.out_dir, exist_ok=True)
        if not os.access(args.out_dir, os.W_OK):
            raise PermissionError(f"{args.out_dir} is not writable")
    except OSError as exc:
        _err(f"error: --out-dir {args.out_dir!r}: {exc}; choose a writable directory")
        return 2
    from overlap.bench.memory import demo_shortfall

    short = demo_shortfall(args.model_size, args.world_size)
    if short is not None:
        _err(f"overlap demo: {short}")
        return 2
    link, why = demo_link(args.link)
    args.link = link  # what _rerun_in_link shapes (None: stay on loopback)
    code = _rerun_in_link(args)
    if code is not None:
        return code
    import torch.distributed.launcher.api  # noqa: F401  (torch's launcher, its loggers)

    from overlap.demo import run_demo

    if not args.verbose:  # the launcher's loggers, made by the import above
        quiet_torch_distributed()
    label = link or "loopback"
    _out(
        f"overlap demo: {args.world_size} local ranks (torch's elastic launcher), a "
        f"{args.model_size} transformer, {args.steps} steps of each variant.\n"
        f"link: {why}.\n"
        f"reproduce: overlap demo --link {link or 'none'} --steps {args.steps} --model-size "
        f"{args.model_size}"
    )
    results = run_demo(args.world_size, args.steps, args.model_size, args.out_dir, label)
    r0 = results[0]
    if args.json:
        _out(json.dumps(r0, indent=2, default=str))
        return 0
    rows = r0["table"]
    choice = r0["auto"]["choice"]
    base, base16 = rows["ddp"]["step_ms"], rows["ddp-fp16"]["step_ms"]
    t = Table(
        [
            "variant",
            "step ms",
            "vs DDP",
            "vs DDP-fp16",
            "exposed comm ms",
            "overlap ratio",
            "bytes/rank/step",
            "final loss",
        ],
        title=f"\n{r0['params'] / 1e6:.2f}M parameters, {r0['world']} ranks, link {label} "
        "(median step, rank 0)",
    )
    for name, r in rows.items():
        t.add(
            **{
                "variant": f"{name} ({choice})" if name == "overlap-auto" else name,
                "step ms": f"{r['step_ms']:.1f}",
                "vs DDP": f"{base / r['step_ms']:.2f}x",
                "vs DDP-fp16": f"{base16 / r['step_ms']:.2f}x",
                "exposed comm ms": "" if r["exposed_ms"] is None else f"{r['exposed_ms']:.1f}",
                "overlap ratio": "" if r["overlap"] is None else f"{r['overlap']:.2f}",
                "bytes/rank/step": human_bytes(r["bytes"]),
                # auto's measuring steps trained it further: its loss is not comparable
                "final loss": "-"
                if name == "overlap-auto"
                else ""
                if r["loss"] is None
                else f"{r['loss']:.3f}",
            }
        )
    _out(t.render())
    if "overlap-auto" in rows:
        _out("- overlap-auto's final loss is left out: its measuring steps trained it further.")
    costs = ", ".join(f"{n} {ms:.0f}" for n, ms in r0["auto"]["costs_ms"].items())
    _out(f"\nauto measured (median step ms, slowest rank): {costs}; chose {choice}.")
    _out(_verdict(rows, choice, label))
    if r0["trace"]:
        _out(
            f"\ntrace of overlap-auto's steps and one DDP step: {r0['trace']} (open it in "
            "https://ui.perfetto.dev or chrome://tracing; or `overlap trace summarize` it)"
        )
    for png in r0["png"]:
        _out(f"picture: {png}")
    if r0["trace"] and not r0["png"]:
        _out("no pictures: they need matplotlib (pip install overlap[plot])")
    return 0


def _run_on_hosts(
    args: argparse.Namespace, module: str, module_args: list[str], what: str
) -> tuple[Any, int]:
    """Run ``python -m module module_args`` as --procs-per-host ranks on each of --hosts
    namespace hosts (torchrun multi-node; --link shapes each host's link); (rank 0's RESULT
    json, 0) or (None, exit code) after saying what went wrong."""
    import subprocess

    from overlap.bench.hosts import namespace_hosts
    from overlap.bench.link import LinkError
    from overlap.bench.stopping import stop_children

    if args.procs_per_host < 1 or args.hosts < 1:
        _err("--hosts and --procs-per-host must be at least 1")
        return None, 2
    try:
        with namespace_hosts(args.hosts, link=args.link) as hosts:
            # each worker as stopping.python_module runs it: quiet on Ctrl-C (torchrun adds -u)
            argv = ["--no-python", *python_module(module, *module_args)]
            procs = hosts.torchrun(
                argv, args.procs_per_host, quiet=not args.verbose, stdout=subprocess.PIPE
            )
            try:
                outs = [p.communicate()[0] for p in procs]
            except BaseException as exc:
                # Ctrl-C reached them too: their own clean-up first, then the hosts go
                stop_children(procs, exc)
                raise
    except (LinkError, ValueError) as exc:
        _err(f"error: {exc}")
        return None, 2
    result = _result(*outs)
    if result is None:
        codes = [p.returncode for p in procs]
        _err(f"{what} failed on the hosts (exit codes {codes}):\n{outs[0][-2000:]}")
        return None, 1
    return result, 0


def _rerun_in_link(args: argparse.Namespace) -> int | None:
    """If --link was given (and we are not inside it yet), run this same command inside a
    shaped network namespace and return its exit code; else None."""
    if not getattr(args, "link", None) or getattr(args, "_in_link", False):
        return None
    if getattr(args, "hosts", 0):
        return None  # --link shapes the links between the namespace hosts instead
    from overlap.bench.guard import with_parent
    from overlap.bench.link import LinkError, shaped_link
    from overlap.bench.stopping import run_child

    argv = list(args._argv)  # what main() parsed (sys.argv, or main(argv)'s list)
    inner = with_parent(python_module("overlap.cli", *argv, "--_in-link"))
    try:
        with shaped_link(args.link) as prefix:
            return run_child([*prefix, *inner])[1]
    except LinkError as exc:
        _err(f"error: {exc}")
        return 2


def cmd_bench_ops(args: argparse.Namespace) -> int:
    code = _rerun_in_link(args)
    if code is not None:
        return code
    from overlap.bench.harness import parse_size
    from overlap.bench.ops import OPS, bench_ops_rank, ops_table
    from overlap.testing import RankPool

    ops = args.op or list(OPS)
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        _err(f"unknown op(s) {unknown}; choose from {list(OPS)}")
        return 2
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.job_timeout is not None and args.backend != "mpi":
        _err(
            "--job-timeout is for --backend mpi: gloo ranks always run with torch's "
            "process-group timeout"
        )
        return 2
    if args.algorithm != "native":
        if args.backend != "gloo":
            # (it ran gloo ranks whatever --backend said)
            _err(f"--algorithm {args.algorithm} runs on gloo ranks; drop --backend {args.backend}")
            return 2
        return _bench_algorithm(sizes, args)
    if args.concurrent is not None:
        return _bench_concurrent(args)
    from overlap.bench.memory import ops_shortfall

    if args.hosts:
        args.world_size = args.hosts * args.procs_per_host
    p2p = [o for o in ops if o in ("sendrecv", "isend-irecv")]
    if args.world_size < 2 and p2p:
        # a rank cannot send to itself: gloo failed with "Pair is not connected", MPI exited 1
        if args.op:
            _err(
                f"--op {p2p[0]} needs a peer, and the job has {args.world_size} rank: pass "
                f"--world-size 2 or more, or leave out --op {p2p[0]}"
            )
            return 2
        ops = [o for o in ops if o not in p2p]
        _err(f"note: {' and '.join(p2p)} left out: they need a peer, and the job has 1 rank")
    short = ops_shortfall(ops, max(sizes), args.world_size)
    if short is not None:
        _err(f"overlap bench ops: {short}")
        return 2
    if args.hosts:
        if args.backend != "gloo":
            _err("--hosts runs gloo ranks under torchrun; drop --backend mpi")
            return 2
        sized = ",".join(map(str, sizes))
        module_args = [",".join(ops), sized, str(args.iters), str(args.warmup), args.loop, "gloo"]
        got, code = _run_on_hosts(args, "overlap.bench.ops", module_args, "the ops benchmark")
        if got is None:
            return code
        rows = got
    elif args.backend == "mpi":
        got = _bench_ops_under_mpiexec(ops, sizes, args)
        if got is None:
            return 1
        rows = got
    else:
        with RankPool(args.world_size, timeout=3600) as pool:
            rows = pool.run(
                bench_ops_rank, ops, sizes, args.iters, args.warmup, args.loop, timeout=3600
            )[0]
    if args.json:
        import json

        _out(json.dumps(rows, indent=2))
    else:
        ref = "MPI" if args.backend == "mpi" else "torch"
        where = (
            f" ({args.hosts} hosts x {args.procs_per_host}, link {args.link or 'unshaped'})"
            if args.hosts
            else ""
        )
        if args.job_timeout is not None:
            where += f", job timeout {args.job_timeout:g} s"
        title = (
            f"overlap bench ops: {args.backend}, {args.world_size} ranks{where}, {args.loop} "
            "(median us, rank 0)"
        )
        table = ops_table(rows, title, reference=ref)
        _out(table.markdown() if args.markdown else table.render())
    return 0


def _bench_concurrent(args: argparse.Namespace) -> int:
    """``bench ops --concurrent N,...``: N awaited all_reduces in flight against the raw
    backend's nonblocking calls, side by side."""
    import json

    from overlap.bench.harness import Table
    from overlap.bench.ops import bench_concurrent_rank
    from overlap.testing import RankPool

    try:
        counts = [int(x) for x in args.concurrent.split(",")]
    except ValueError:
        _err(f"--concurrent takes counts like 2000,10000, got {args.concurrent!r}")
        return 2
    if any(n < 1 for n in counts):
        _err(f"--concurrent counts must be at least 1, got {counts}")
        return 2
    reps = args.iters if args.iters != 200 else 3  # --iters' default is for the op table
    if args.backend == "mpi":
        args.iters = reps
        got = _bench_ops_under_mpiexec(["concurrent"], counts, args)
        if got is None:
            return 1
        rows = got
    else:
        with RankPool(args.world_size, timeout=3600) as pool:
            rows = [
                row
                for n in counts
                for row in pool.run(bench_concurrent_rank, n, reps, args.loop, timeout=3600)[0]
            ]
    if args.json:
        _out(json.dumps(rows, indent=2))
        return 0
    ref = "mpi4py Iallreduce + Waitall" if args.backend == "mpi" else "torch async_op + wait"
    t = Table(
        ["in flight", "awaited", "overlap awaited s", "raw s", "overlap/raw"],
        title=f"{args.backend}, {args.world_size} ranks: small all_reduces in flight at once "
        f"(median of {reps}; raw: {ref})",
    )
    for r in rows:
        t.add(
            **{
                "in flight": r["in_flight"],
                "awaited": r["order"],
                "overlap awaited s": round(r["ours_s"], 3),
                "raw s": round(r["raw_s"], 3),
                "overlap/raw": round(r["ours/raw"], 2),
            }
        )
    _out(t.markdown() if args.markdown else t.render())
    return 0


def _bench_algorithm(sizes: list[int], args: argparse.Namespace) -> int:
    import json

    from overlap.bench.harness import Table, human_bytes
    from overlap.bench.ops import bench_algorithms_rank
    from overlap.testing import RankPool

    with RankPool(args.world_size, timeout=3600) as pool:
        rows = pool.run(
            bench_algorithms_rank,
            sizes,
            args.iters,
            args.warmup,
            args.algorithm,
            args.loop,
            timeout=3600,
        )[0]
    if args.json:
        _out(json.dumps(rows, indent=2))
        return 0
    a = args.algorithm
    t = Table(
        [
            "size",
            "native us",
            f"{a} us",
            f"{a} await us",
            f"{a}/native",
            "native busbw GB/s",
            f"{a} busbw GB/s",
        ],
        title=f"all_reduce: {a} (awaitable isend/irecv) vs native gloo, "
        f"{args.world_size} ranks (median us, rank 0)",
    )
    for r in rows:
        t.add(
            **{
                "size": human_bytes(r["bytes"]),
                "native us": r["native_us"],
                f"{a} us": r["blocking_us"],
                f"{a} await us": r["await_us"],
                f"{a}/native": round(r[f"{a}/native"], 3),
                "native busbw GB/s": round(r["native_busbw"], 3),
                f"{a} busbw GB/s": round(r[f"{a}_busbw"], 3),
            }
        )
    _out(t.markdown() if args.markdown else t.render())
    return 0


def _bench_ops_under_mpiexec(
    ops: list[str], sizes: list[int], args: argparse.Namespace
) -> list[Any] | None:
    import os
    import shutil
    from pathlib import Path

    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which(
        "mpiexec"
    )
    if mpiexec is None:
        _err("--backend mpi needs mpiexec: pip install overlap[mpi]")
        return None
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [
        mpiexec,
        "-n",
        str(args.world_size),
        *python_module(
            "overlap.bench.ops",
            ",".join(ops),
            ",".join(map(str, sizes)),
            str(args.iters),
            str(args.warmup),
            args.loop,
            "mpi",
        ),
    ]
    if args.job_timeout is not None:
        cmd.append(repr(args.job_timeout))
    from overlap.bench.stopping import mpiexec_leftovers_removed

    with mpiexec_leftovers_removed():  # a Ctrl-C aborts the job, and MPICH leaves a file
        rows, _ = _run_json(cmd, None, "the MPI benchmark", env=env)
    return rows if rows is None else list(rows)


def _no_cuda() -> bool:
    """True, with the error said, when ``--device cuda`` was asked for and no GPU is seen."""
    import torch

    if torch.cuda.is_available():
        return False
    _err(
        "--device cuda: no CUDA device is visible here (torch "
        f"{torch.__version__}); run on a GPU machine, or use --device cpu"
    )
    return True


def cmd_bench_compress(args: argparse.Namespace) -> int:
    import json

    from overlap.bench.compress import bench_codec
    from overlap.bench.harness import Table, human_bytes, parse_size

    if args.device == "cuda" and not args.skip_codec and _no_cuda():
        return 2
    sizes = [parse_size(s) // 4 for s in args.sizes.split(",")]
    report: dict[str, Any] = {}
    if not args.skip_codec:
        rows = bench_codec(sizes, args.reps, args.device)
        report["codec"] = rows
        t = Table(
            [
                "floats",
                "read ms",
                "worker ms",
                "worker/read",
                "server+rebuild/read",
                "unpack/read",
                "worker GB/s",
            ],
            title=f"OneBit codec ({rows[0]['codec'] if rows else '-'}, "
            f"{rows[0]['threads'] if rows else '-'} threads) on {args.device} (median of "
            f"{args.reps}), against one read pass (torch.sum)",
        )
        for r in rows:
            t.add(
                **{
                    "floats": f"{r['floats'] / 2**20:.0f}M",
                    "read ms": r["read_ms"],
                    "worker ms": r["worker_ms"],
                    "worker/read": r["worker/read"],
                    "server+rebuild/read": r["server+rebuild/read"],
                    "unpack/read": r["unpack/read"],
                    "worker GB/s": r["worker_GBps"],
                }
            )
        if not args.json:
            _out(t.markdown() if args.markdown else t.render())
    if args.allreduce_size:
        nbytes = parse_size(args.allreduce_size)
        cmd = python_module(
            "overlap.bench.compress", str(nbytes), str(args.iters), str(args.world_size)
        )
        res, code = _run_json(cmd, args.link, "the link benchmark")
        if res is None:
            return code
        res["link"] = args.link or "loopback"
        report["allreduce"] = res
        if not args.json:
            t2 = Table(
                [
                    "link",
                    "size",
                    "fp32 all_reduce ms",
                    "compressed ms",
                    "speed-up",
                    "bytes/rank fp32",
                    "bytes/rank 1-bit",
                ],
                title=f"\n{args.world_size} ranks, median of {args.iters}",
            )
            t2.add(
                **{
                    "link": res["link"],
                    "size": human_bytes(res["bytes"]),
                    "fp32 all_reduce ms": res["allreduce_ms"],
                    "compressed ms": res["compressed_ms"],
                    "speed-up": res["speedup"],
                    "bytes/rank fp32": human_bytes(res["fp32_bytes_per_rank"]),
                    "bytes/rank 1-bit": human_bytes(res["compressed_bytes_per_rank"]),
                }
            )
            _out(t2.markdown() if args.markdown else t2.render())
    if args.json:
        _out(json.dumps(report, indent=2))
    return 0


def cmd_bench_train(args: argparse.Namespace) -> int:
    import json

    from overlap.bench.harness import Table, human_bytes, interval_cell
    from overlap.bench.train import (
        ALL_VARIANTS,
        CUDA_VARIANTS,
        DILOCO_BACKGROUND_ENV,
        DILOCO_FRAGMENTS_ENV,
        DILOCO_H_ENV,
        DILOCO_PASS_THREAD_ENV,
        PIN_HEAP_ENV,
        THREADS_ENV,
        VARIANTS,
    )

    variants = args.variant or (CUDA_VARIANTS if args.device == "cuda" else VARIANTS)
    bad = [v for v in variants if v not in ALL_VARIANTS]
    if bad:
        _err(f"unknown variant(s) {bad}; choose from {ALL_VARIANTS}")
        return 2
    if args.device not in ("cpu", "cuda"):
        _err(f"--device {args.device!r}: choose cpu or cuda")
        return 2
    if args.device == "cuda":
        import torch

        if _no_cuda():
            return 2
        world = args.world_size or 1
        if world > torch.cuda.device_count():
            _err(
                f"--device cuda --world-size {world}: NCCL needs one GPU per rank and this "
                f"machine has {torch.cuda.device_count()}; use --world-size "
                f"{torch.cuda.device_count()}"
            )
            return 2
        if args.link:
            _err("--link shapes loopback between CPU ranks; it does not apply to --device cuda")
            return 2
    else:
        world = args.world_size or 2
    if args.hosts and args.device == "cuda":
        _err("--hosts simulates CPU hosts with network namespaces; it does not apply to cuda")
        return 2
    if args.hosts:
        world = args.hosts * args.procs_per_host
    batch = args.batch or (1024 if args.device == "cuda" else 64)
    if args.device == "cpu":
        from overlap.bench.memory import train_shortfall
        from overlap.bench.train import model_params

        short = train_shortfall(variants, model_params(args.model_size), world)
        if short is not None:
            _err(f"overlap bench train: {short}")
            return 2
    if args.pin_heap:
        for k, v in PIN_HEAP_ENV.items():  # each rank process inherits this environment
            os.environ.setdefault(k, v)
    if args.diloco_fragments is not None:
        if args.diloco_fragments < 1:
            _err(
                f"--diloco-fragments {args.diloco_fragments}: streaming DiLoCo needs at least "
                "one fragment; use 1 or more (default 8)"
            )
            return 2
        os.environ[DILOCO_FRAGMENTS_ENV] = str(args.diloco_fragments)
    if args.diloco_sync_every is not None:
        os.environ[DILOCO_H_ENV] = str(args.diloco_sync_every)
    os.environ[THREADS_ENV] = str(args.threads)  # every rank process inherits it
    os.environ[DILOCO_PASS_THREAD_ENV] = args.diloco_pass_thread
    os.environ[DILOCO_BACKGROUND_ENV] = args.diloco_background
    tail = [",".join(variants), str(args.steps), str(args.warmup), str(args.model_size)]
    if args.hosts:
        rows, code = _run_on_hosts(
            args, "overlap.bench.train", [*tail, "env", str(batch), "cpu"], "the training benchmark"
        )
    else:
        cmd = python_module("overlap.bench.train", *tail, str(world), str(batch))
        rows, code = _run_json([*cmd, args.device], args.link, "the training benchmark")
    if rows is None:
        return code
    if args.plot:
        from overlap.bench.train import plot_steps

        plot_steps(rows, args.plot, args.link or "loopback")
    if args.json:
        _out(json.dumps(rows, indent=2))
        return 0
    base = next((r["step_ms"] for r in rows if r["variant"] == "ddp"), None)
    adam_base = next((r["step_ms"] for r in rows if r["variant"] == "ddp-adamw"), base)

    def vs_ddp(r: dict[str, Any]) -> str:
        b = adam_base if "adam" in r["variant"] else base
        return f"{b / r['step_ms']:.2f}x" if b else ""

    floor = next((r["step_ms"] for r in rows if r["variant"] == "compute"), None)

    def ms(v: Any) -> str:
        return "" if v in (None, "") else f"{v:.1f}"

    # DiLoCo rows: the step against their own model stepped without DiLoCo (like tensors:
    # separate model instances ran up to 10% apart on the 2-core machine)
    own = any("own_compute_ms" in r for r in rows)

    t = Table(
        [
            "variant",
            "step ms",
            "slowest ms",
            "vs DDP",
            "90%",
            "x compute",
            "90% ",
            *(["x own compute"] if own else []),
            "bytes/rank/step",
            "comm ms",
            "exposed ms",
            "overlap ratio",
            "worker CPU ms",
            "1st compressed step ms",
        ],
        title=f"overlap bench train: {rows[0]['params'] / 1e6:.1f}M params, batch {batch}, "
        f"{world} ranks on {rows[0]['device']}"
        + (f" ({args.hosts} hosts x {args.procs_per_host})" if args.hosts else "")
        + (f", {args.threads} threads a rank" if args.threads > 1 else "")
        + ", link "
        + f"{'NCCL' if args.device == 'cuda' else args.link or 'loopback'}"
        + (" between hosts" if args.hosts else "")
        + f" (median of {args.steps} steps, rank 0)",
    )
    for r in rows:
        t.add(
            **{
                "variant": r["variant"]
                + (f" ({r['choice']})" if r.get("choice") else "")
                + (" [node]" if r.get("hierarchical") else ""),
                "step ms": ms(r["step_ms"]),
                "slowest ms": ms(r.get("max_step_ms")),
                "vs DDP": vs_ddp(r),
                "90%": interval_cell(r.get("vs_ddp_90")),
                "x compute": f"{r['step_ms'] / floor:.2f}" if floor else "",
                "90% ": interval_cell(r.get("x_compute_90")),
                # a cell only where the column is there (Table shows its columns alone)
                "x own compute": f"{r['step_ms'] / r['own_compute_ms']:.3f}"
                if "own_compute_ms" in r
                else "",
                "bytes/rank/step": ""
                if r["bytes_per_rank"] is None
                else human_bytes(r["bytes_per_rank"]),
                "comm ms": ms(r.get("comm_ms")),
                "exposed ms": ms(r.get("exposed_ms")),
                "overlap ratio": round(r["overlap_ratio"], 2) if "overlap_ratio" in r else "",
                "worker CPU ms": ms(r.get("worker_cpu_ms")),
                "1st compressed step ms": ms(r.get("first_compressed_ms")),
            }
        )
    _out(t.markdown() if args.markdown else t.render())
    return 0


def cmd_bench_lm(args: argparse.Namespace) -> int:
    import json

    from overlap.bench.harness import Table, human_bytes
    from overlap.bench.lm import LM_VARIANTS, known_variant, plot_lm, time_to_loss

    variants = args.variant or LM_VARIANTS
    bad = [v for v in variants if not known_variant(v)]
    if bad:
        _err(
            f"unknown variant(s) {bad}; choose from {LM_VARIANTS} or a DiLoCo spelling "
            "diloco[-stream][-int8|-bf16|-fp8][-hH][-fF][-dD][-olrX][-omY][-aA]"
        )
        return 2
    freeze = args.freeze_step if args.freeze_step is not None else max(1, args.steps * 15 // 100)
    if not 1 <= freeze < args.steps:
        _err(f"--freeze-step {freeze}: choose 1 <= freeze-step < --steps ({args.steps})")
        return 2
    cmd = python_module(
        "overlap.bench.lm",
        ",".join(variants),
        str(args.steps),
        str(freeze),
        str(args.world_size),
        str(args.lr),
        str(args.layers),
        str(args.width),
        str(args.diloco_steps or args.steps),
        str(args.seed),
    )
    rows, code = _run_json(cmd, args.link, "the language-model benchmark")
    if rows is None:
        return code
    if args.plot:
        plot_lm(rows, args.plot)
    if args.plot_time:
        plot_lm(rows, args.plot_time, x="time")
    if args.json:
        _out(json.dumps(rows, indent=2))
        return 0
    base = next((r for r in rows if r["variant"] == "ddp-adamw"), None)
    t = Table(
        [
            "variant",
            "final train loss",
            "held-out loss",
            "held-out, global weights",
            "held-out, finished",
            "vs DDP",
            "bytes/step warm-up",
            "bytes/step after freeze",
            "wire bytes/step",
            "wall s",
            "s to DDP's loss",
        ],
        title=f"overlap bench lm: {rows[0]['params'] / 1e6:.2f}M-param byte-level GPT, "
        f"{args.world_size} ranks, {args.steps} steps, freeze_step {freeze}, lr {args.lr}, "
        f"seed {args.seed}, "
        f"link {args.link or 'loopback'} (train loss: mean of the last 20 steps; held-out "
        "loss: each rank's own weights, averaged over ranks; s to DDP's loss: wall time "
        "until the 20-step mean first reaches DDP's final one)",
    )
    for r in rows:
        rel = (
            f"{100 * (r['held_out_loss'] / base['held_out_loss'] - 1):+.1f}%"
            if base is not None
            else ""
        )
        t.add(
            **{
                "variant": r["variant"],
                "final train loss": f"{r['final_train_loss']:.3f}",
                "held-out loss": f"{r['held_out_loss']:.3f}",
                # DiLoCo's agreed model (DiLoCo.global_weights()); the local weights above
                "held-out, global weights": (
                    f"{r['held_out_loss_global']:.3f}" if r["variant"].startswith("diloco") else ""
                ),
                # the model DiLoCo.finish() ends on, the same on every rank
                "held-out, finished": (
                    f"{r['held_out_loss_final']:.3f}" if r["variant"].startswith("diloco") else ""
                ),
                "vs DDP": rel,
                "bytes/step warm-up": human_bytes(r["bytes_warmup_step"]),
                "bytes/step after freeze": human_bytes(r["bytes_after_freeze_step"]),
                "wire bytes/step": (
                    human_bytes(r["wire_bytes_step"]) if r.get("wire_bytes_step") else ""
                ),
                "wall s": f"{r['wall_s']:.1f}",
                "s to DDP's loss": (
                    _fmt_opt(time_to_loss(r, base["final_train_loss"])) if base is not None else ""
                ),
            }
        )
    _out(t.markdown() if args.markdown else t.render())
    return 0


def _fmt_opt(x: float | None) -> str:
    return "never" if x is None else f"{x:.1f}"


def cmd_trace_summarize(args: argparse.Namespace) -> int:
    from overlap.trace import OverlapReport, TraceFormatError, load_spans

    try:
        spans, world = load_spans(args.trace)
    except TraceFormatError as exc:
        _err(f"error: {exc}")
        return 2
    report = OverlapReport.from_spans(spans, world=world)
    _out(report.to_json() if args.json else report.render())
    return 0


def cmd_trace_plot(args: argparse.Namespace) -> int:
    from overlap.trace import TraceFormatError, load_spans
    from overlap.trace.plot import parse_steps, plot_timeline

    try:
        steps = parse_steps(args.steps)
        spans, _ = load_spans(args.trace)
        plot_timeline(spans, args.output, title=f"{args.trace}, steps {args.steps}", steps=steps)
    except (TraceFormatError, ValueError, ImportError) as exc:
        _err(f"error: {exc}")
        return 2
    _out(f"wrote {args.output}")
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    import platform
    from importlib.metadata import version

    import torch
    import torch.distributed as dist

    import overlap
    from overlap.compression import codec_numba
    from overlap.runtime import uvloop_available

    _out(f"overlap {overlap.__version__} on Python {platform.python_version()}")
    _out(f"torch {torch.__version__}")
    _out(f"gloo: {'yes' if dist.is_gloo_available() else 'no'}")
    _out(f"nccl: {'yes' if dist.is_nccl_available() else 'no'}")
    try:
        from mpi4py import MPI

        _out(f"mpi: mpi4py, {MPI.Get_library_version().splitlines()[0].strip()}")
    except ImportError:
        _out("mpi: no (pip install overlap[mpi])")
    cuda = torch.cuda.is_available()
    _out(
        f"cuda: {torch.version.cuda if cuda else 'not available'}"
        + (f", {torch.cuda.device_count()} device(s)" if cuda else "")
    )
    if uvloop_available():
        _out(f"uvloop: {version('uvloop')}")
    else:
        _out("uvloop: not installed (asyncio's default loop is used)")
    if codec_numba.available():
        _out(f"1-bit codec on CPU: numba kernels (numba {version('numba')})")
    else:
        _out("1-bit codec on CPU: torch ops, several times slower (pip install numba)")
    from overlap.comm.rendezvous import report

    for line in report():  # what init_distributed would meet here (run it on each host)
        _out(line)
    return 0


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an int of at least ``minimum`` (argparse then prints the usage and
    the problem, instead of a traceback or a table of NaNs from --iters 0)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _link(*words: str) -> Callable[[str], str]:
    """An argparse type for ``--link``: a positive tc rate, or one of ``words`` (the demo's
    ``auto`` and ``none``), checked before any namespace is made or rank started."""

    def parse(text: str) -> str:
        if text in words:
            return text
        from overlap.bench.link import check_rate

        try:
            return check_rate(text)
        except ValueError as exc:
            extra = f" (or {', '.join(words)})" if words else ""
            raise argparse.ArgumentTypeError(f"{exc}{extra}") from None

    return parse


def _picture(text: str) -> str:
    """An argparse type for a picture's path (--plot, -o): checked before the run that draws
    it (overlap.pictures.check_path), not after it with matplotlib's traceback."""
    from overlap.pictures import check_path

    try:
        return check_path(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_float(text: str) -> float:
    """An argparse type: a finite float above 0 (--model-size, --lr; the check is
    overlap.argcheck.positive_real's, the constructors' own)."""
    from overlap.argcheck import positive_real

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    try:
        return positive_real(text, value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}") from None


def _size(text: str) -> str:
    """An argparse type for one size (4, 64KiB, 1MiB), or '' where the option allows it."""
    return _size_list(text) if text else text


def _size_list(text: str) -> str:
    """An argparse type for --sizes: checked here, parsed again by the command."""
    from overlap.bench.harness import parse_size

    try:
        for part in text.split(","):
            parse_size(part)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="overlap", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="log progress (INFO)")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="run the local demo: DDP vs overlap on local ranks")
    d.add_argument("--world-size", type=_at_least(1), default=2)
    d.add_argument("--steps", type=_at_least(1), default=10, help="timed steps per variant")
    d.add_argument("--model-size", choices=["small", "medium", "large"], default="medium")
    d.add_argument(
        "--link",
        type=_link("auto", "none", "loopback"),
        default="auto",
        help="auto (the default: 1gbit when root, else plain loopback), none, or a rate "
        "such as 1gbit or 100mbit (root)",
    )
    d.add_argument("--out-dir", default=".", help="where to write the trace and the timeline")
    d.add_argument("--json", action="store_true")
    d.add_argument("--_in-link", dest="_in_link", action="store_true", help=argparse.SUPPRESS)
    d.set_defaults(func=cmd_demo)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    bo = bsub.add_parser("ops", help="blocking vs h.wait() vs await, per op and size")
    bo.add_argument("--op", action="append", help="op to measure (repeatable); default all")
    bo.add_argument(
        "--sizes",
        type=_size_list,
        default="4,1KiB,64KiB,1MiB,16MiB,64MiB",
        help="comma-separated sizes in bytes (4, 64KiB, 1MiB, ...)",
    )
    bo.add_argument("--world-size", type=_at_least(1), default=2)
    bo.add_argument(
        "--algorithm",
        choices=["native", "ring", "naive"],
        default="native",
        help="ring/naive: compare that all_reduce algorithm with native",
    )
    bo.add_argument(
        "--backend",
        choices=["gloo", "mpi"],
        default="gloo",
        help="gloo (ranks started here) or mpi (ranks started by mpiexec)",
    )
    bo.add_argument(
        "--hosts",
        type=_at_least(0),
        default=0,
        help="run on this many simulated hosts (network namespaces, root); --link then "
        "shapes each host's link to the others; 0 (the default): the ranks on this host",
    )
    bo.add_argument(
        "--procs-per-host", type=_at_least(1), default=1, help="ranks per host (--hosts)"
    )
    bo.add_argument("--iters", type=_at_least(1), default=200, help="iterations for small sizes")
    bo.add_argument("--warmup", type=_at_least(0), default=5)
    bo.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    bo.add_argument(
        "--concurrent",
        default=None,
        metavar="N[,N...]",
        help="instead: N small all_reduces in flight at once, awaited, against the backend's "
        "own nonblocking calls (--iters repetitions, default 3)",
    )
    bo.add_argument("--json", action="store_true", help="print the rows as JSON")
    bo.add_argument("--markdown", action="store_true", help="print a Markdown table")
    bo.add_argument(
        "--link",
        type=_link(),
        default=None,
        help="run the ranks on a loopback shaped to this rate, e.g. 1gbit (root)",
    )
    bo.add_argument(
        "--job-timeout",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help="--backend mpi: the ranks' init_distributed(timeout=SECONDS), to measure what a "
        "job timeout costs each op (MPI has none unless asked; gloo always runs with "
        "torch's process-group timeout)",
    )
    bo.add_argument("--_in-link", dest="_in_link", action="store_true", help=argparse.SUPPRESS)
    bo.set_defaults(func=cmd_bench_ops)

    bc = bsub.add_parser("compress", help="OneBit codec cost; compressed vs fp32 allreduce")
    bc.add_argument(
        "--sizes",
        type=_size_list,
        default="4MiB,16MiB,64MiB,256MiB",
        help="buffer sizes for the codec part (bytes of fp32)",
    )
    bc.add_argument("--reps", type=_at_least(1), default=5)
    bc.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="the codec part's device"
    )
    bc.add_argument("--skip-codec", action="store_true", help="only the allreduce part")
    bc.add_argument(
        "--allreduce-size",
        type=_size,
        default="64MiB",
        help="buffer for compressed vs fp32 allreduce ('' to skip)",
    )
    bc.add_argument("--iters", type=_at_least(1), default=5)
    bc.add_argument("--world-size", type=_at_least(1), default=2)
    bc.add_argument(
        "--link",
        type=_link(),
        default=None,
        help="run the ranks on a loopback shaped to this rate (e.g. 1gbit; root)",
    )
    bc.add_argument("--json", action="store_true")
    bc.add_argument("--markdown", action="store_true")
    bc.set_defaults(func=cmd_bench_compress)

    bt = bsub.add_parser("train", help="step time: compute only, DDP (+hooks), overlap")
    bt.add_argument(
        "--variant",
        action="append",
        help="variant to run (repeatable); beyond the default set: ddp-adamw, "
        "overlap-onebitadam, onebitadam-serial",
    )
    bt.add_argument(
        "--model-size",
        type=_positive_float,
        default=25.2,
        help="million parameters (rounded to whole 2048-wide layers of 4.2M, at least one)",
    )
    bt.add_argument("--steps", type=_at_least(1), default=8)
    bt.add_argument("--warmup", type=_at_least(0), default=3)
    bt.add_argument(
        "--world-size", type=_at_least(1), default=None, help="ranks (default 2 on cpu, 1 on cuda)"
    )
    bt.add_argument(
        "--link", type=_link(), default=None, help="shaped loopback rate, e.g. 1gbit (root)"
    )
    bt.add_argument(
        "--hosts",
        type=_at_least(0),
        default=0,
        help="run on this many simulated hosts (network namespaces, root); --link then "
        "shapes each host's link to the others; 0 (the default): the ranks on this host",
    )
    bt.add_argument(
        "--procs-per-host", type=_at_least(1), default=2, help="ranks per host (--hosts)"
    )
    bt.add_argument(
        "--device",
        default="cpu",
        help="cpu (gloo ranks) or cuda (NCCL, one rank per GPU; the scheduler's GPU overhead)",
    )
    bt.add_argument(
        "--batch", type=_at_least(1), default=None, help="default 64 on cpu, 1024 on cuda"
    )
    bt.add_argument(
        "--plot", type=_picture, default=None, help="write step time against step to this PNG"
    )
    bt.add_argument(
        "--pin-heap",
        action="store_true",
        help="keep freed memory in glibc's heap in the rank processes (MALLOC_TRIM_THRESHOLD_, "
        "MALLOC_MMAP_THRESHOLD_) and back it with huge pages (GLIBC_TUNABLES="
        "glibc.malloc.hugetlb=1; a value you set is kept), so a step's gradients are not "
        "page-faulted back every step in some phases of a run and not others; every variant "
        "runs with it",
    )
    bt.add_argument(
        "--diloco-fragments",
        type=_at_least(1),
        default=None,
        help="fragments of diloco-streaming (default 8; at most one per parameter tensor): "
        "more fragments spread the same sync work over more steps",
    )
    bt.add_argument(
        "--diloco-sync-every",
        type=_at_least(1),
        default=None,
        help="H of the diloco variants: inner steps between a parameter's syncs (default 32, "
        "which fits 1 Gbit/s and 100 Mbit/s at this model's steps; 8 is the H of the "
        "convergence figures); streaming lands each fragment about H // 2 steps after it "
        "is issued, midway between two issues",
    )
    bt.add_argument(
        "--threads",
        type=_at_least(1),
        default=1,
        help="torch intra-op threads per rank (default 1: every variant's ranks share the "
        "machine alike); more computes faster on a machine with cores to spare, which is "
        "where a slow link's cost shows",
    )
    for flag, what in (
        (
            "--diloco-pass-thread",
            "DiLoCo(pass_thread=) of the diloco variants: take streaming's pseudo-gradient "
            "on a thread of its own under the next forward and backward (on), inside step() "
            "(off), or on when each rank has a core to spare (auto, the default)",
        ),
        (
            "--diloco-background",
            "DiLoCo(background=) of the diloco variants: run streaming's reductions at the "
            "lowest CPU priority (on), at normal priority (off), or on when the ranks have "
            "no core to spare (auto, the default)",
        ),
    ):
        bt.add_argument(flag, choices=["auto", "on", "off"], default="auto", help=what)
    bt.add_argument("--json", action="store_true")
    bt.add_argument("--markdown", action="store_true")
    bt.set_defaults(func=cmd_bench_train)

    bl = bsub.add_parser("lm", help="convergence: a byte-level transformer LM, DDP vs 1-bit Adam")
    bl.add_argument("--variant", action="append", help="variant to run (repeatable)")
    bl.add_argument("--steps", type=_at_least(1), default=400)
    bl.add_argument(
        "--freeze-step", type=_at_least(1), default=None, help="OneBitAdam's warm-up (default 15%%)"
    )
    bl.add_argument("--lr", type=_positive_float, default=1e-3)
    bl.add_argument("--layers", type=_at_least(1), default=2)
    bl.add_argument("--width", type=_at_least(1), default=128)
    bl.add_argument("--world-size", type=_at_least(1), default=2)
    bl.add_argument(
        "--diloco-steps",
        type=_at_least(1),
        default=None,
        help="steps of DiLoCo variants (default --steps)",
    )
    bl.add_argument(
        "--seed",
        type=_at_least(0),
        default=0,
        help="model initialisation and data-order seed (default 0; repeat runs with others "
        "to see one seed's spread)",
    )
    bl.add_argument(
        "--link", type=_link(), default=None, help="shaped loopback rate, e.g. 100mbit (root)"
    )
    bl.add_argument("--plot", type=_picture, default=None, help="write the loss curves to this PNG")
    bl.add_argument("--plot-time", type=_picture, default=None, help="the same against wall time")
    bl.add_argument("--json", action="store_true")
    bl.add_argument("--markdown", action="store_true")
    bl.set_defaults(func=cmd_bench_lm)

    tr = sub.add_parser("trace", help="read a trace written by Tracer.export_chrome")
    trs = tr.add_subparsers(dest="trace_cmd", required=True)
    ts = trs.add_parser("summarize", help="print the overlap report of a trace file")
    ts.add_argument("trace")
    ts.add_argument("--json", action="store_true")
    ts.set_defaults(func=cmd_trace_summarize)
    tp = trs.add_parser("plot", help="draw a per-rank timeline PNG (needs matplotlib)")
    tp.add_argument("trace")
    tp.add_argument("-o", "--output", type=_picture, default="overlap-timeline.png")
    tp.add_argument(
        "--steps",
        default="-2:",
        help="steps to draw, slice syntax over the complete steps: 10:12, 5, -2: (the "
        "default: the last two, leaving warm-up and compile steps out), : for all",
    )
    tp.set_defaults(func=cmd_trace_plot)

    e = sub.add_parser("env", help="report torch, backends, MPI, CUDA and uvloop")
    e.set_defaults(func=cmd_env)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args._argv = argv
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s: %(message)s",
    )
    try:
        with terminate_as_exit():  # kill: clean-up runs (its ranks, folders, namespaces)
            # torch and overlap's names, loaded here (not at ``import overlap``: --help
            # and a bad argument answer at once), with a Ctrl-C held until they are in
            imports_held("overlap._preload")
            if not args.verbose:
                quiet_torch_distributed()
            code: Any = args.func(args)
    except BrokenPipeError:
        # the reader went away (``overlap env | head``): as a shell tool ends, without a
        # traceback; stdout goes to /dev/null so that the interpreter's own flush at exit
        # does not raise again (the Python documentation's recipe, "Note on SIGPIPE")
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + int(signal.SIGPIPE)
    except BaseException as exc:
        # Ctrl-C reaches the whole process group (ranks, launchers, benchmark subprocesses),
        # which end on their own; the user asked for it, so a line, not a traceback. torch's
        # elastic launcher (the demo's) turns the signal into its own SignalException.
        sig = _stopped_by(exc)
        if sig is None:
            raise
        if not getattr(args, "_in_link", False):  # the outer process says it, once
            _err("overlap: interrupted")
        return 128 + sig
    return int(code)


def _stopped_by(exc: BaseException) -> int | None:
    """The signal number when ``exc`` is how a signal stopped a command (Ctrl-C's
    KeyboardInterrupt, or torch elastic's SignalException), else None."""
    if isinstance(exc, KeyboardInterrupt):
        return int(signal.SIGINT)
    if type(exc).__name__ == "SignalException":
        return int(getattr(exc, "sigval", signal.SIGINT))
    return None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
