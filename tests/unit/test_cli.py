"""The command line: demo, bench ops and env run end to end and say sensible things."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OVERLAP = [sys.executable, "-m", "overlap.cli"]


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*OVERLAP, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_env_reports_backends() -> None:
    out = run("env")
    assert out.returncode == 0, out.stderr
    for word in ("torch 2.", "gloo: yes", "nccl:", "mpi:", "cuda:", "uvloop:"):
        assert word in out.stdout


def test_demo_runs_two_ranks_and_reports_speedup() -> None:
    out = run("demo", "--steps", "2", "--dim", "128", "--layers", "3")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "compute, then blocking all_reduce" in out.stdout
    assert "awaited all_reduce overlapped" in out.stdout
    assert "speed-up:" in out.stdout


def test_bench_ops_json() -> None:
    out = run(
        "bench",
        "ops",
        "--op",
        "all_reduce",
        "--op",
        "sendrecv",
        "--sizes",
        "4,4KiB",
        "--iters",
        "5",
        "--warmup",
        "1",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [(r["op"], r["bytes"]) for r in rows] == [
        ("all_reduce", 4),
        ("all_reduce", 4096),
        ("sendrecv", 4),
        ("sendrecv", 4096),
    ]
    for r in rows:
        assert r["await_us"] > 0 and r["blocking_us"] > 0 and r["torch_us"] > 0


def test_bench_ops_rejects_unknown_op() -> None:
    out = run("bench", "ops", "--op", "allreduce")
    assert out.returncode == 2 and "choose from" in out.stdout


def test_torchrun_example() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            "0",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "127.0.0.1:0",
            str(ROOT / "examples" / "async_allreduce.py"),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "averaged over 2 ranks: [0.5, 1.5, 2.5, 3.5]" in out.stdout
