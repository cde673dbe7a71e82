"""The command line: demo, bench ops and env run end to end and say sensible things."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.polling import until

ROOT = Path(__file__).resolve().parents[2]
OVERLAP = [sys.executable, "-m", "overlap.cli"]


def run(
    *args: str, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*OVERLAP, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env
    )


def assert_cli_refuses(capsys: pytest.CaptureFixture[str], args: list[str], says: str) -> None:
    """``overlap args``, run in this process, exits 2 saying ``says`` on stderr and nothing
    on stdout (no traceback: one would be an exception raised here)."""
    from overlap import cli

    try:  # argparse's refusals exit; the commands' own checks return the code
        code: object = cli.main(args)
    except SystemExit as exited:
        code = exited.code
    said = capsys.readouterr()
    assert code == 2 and says in said.err, (args, code, said.err)
    assert not said.out, (args, said.out)


def test_env_reports_backends() -> None:
    out = run("env")
    assert out.returncode == 0, out.stderr
    for word in ("torch 2.", "gloo: yes", "nccl:", "mpi:", "cuda:", "uvloop:"):
        assert word in out.stdout
    # numba is a default dependency: the fast codec is what a plain install gets
    assert "1-bit codec on CPU: numba kernels (numba 0." in out.stdout, out.stdout


def test_demo_runs_two_ranks_and_writes_trace_and_timeline(tmp_path: Path) -> None:
    scratch = tmp_path / "tmp"  # the demo's TMPDIR: it must leave nothing there
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch)}
    out = run("demo", "--steps", "2", "--model-size", "small", "--out-dir", str(tmp_path), env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    # as root the ranks ran in a namespace, where c10d's name lookups warned before
    assert "cannot be retrieved" not in out.stderr, out.stderr
    # torch's launcher left a torchelastic_* here before; torch's compile cache is meant to stay
    left = [p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor_")]
    assert not left, left
    for variant in ("ddp", "overlap-none", "overlap-fp16", "overlap-onebit"):
        assert variant in out.stdout
    assert "overlap ratio" in out.stdout and "ui.perfetto.dev" in out.stdout
    # auto's loss is not comparable, and the table says why rather than leave a blank
    assert "overlap-auto's final loss is left out" in out.stdout
    trace = json.loads((tmp_path / "overlap-trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
    assert (tmp_path / "overlap-timeline.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("after_s", [0.3, 5.0], ids=["ranks-importing", "ranks-training"])
def test_ctrl_c_of_the_demo_ends_with_one_line(after_s: float, tmp_path: Path) -> None:
    """Ctrl-C while the demo's ranks import torch, or while they train: exit 130 with
    ``overlap: interrupted`` alone, and no rank left. Before (fifty-seventh session) a rank
    still importing printed its traceback, and a Ctrl-C during training reached each rank
    twice (the terminal's, and the launcher's copy): one died with "Fatal Python error:
    Aborted" at exit, and every rank's scheduler logged the interrupted step."""
    import signal
    import time

    proc = _foreground_job("demo", "--link", "none", "--steps", "1000", "--out-dir", str(tmp_path))

    def ranks() -> list[str]:  # each in a session of its own, under the launcher
        got = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
        return [r for r in got.stdout.split() if "overlap.demo" in _cmdline(r)]

    seen: list[str] = []
    try:
        assert until(lambda: len(ranks()) == 2, 60, every=0.02), "the ranks did not start"
        seen = ranks()
        time.sleep(after_s)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, (proc.returncode, err[-2000:])
        assert err.strip() == "overlap: interrupted", err[-3000:]
        assert until(lambda: not any(_cmdline(r) for r in seen), 15), seen
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for r in seen:
            with contextlib.suppress(OSError):
                os.kill(int(r), signal.SIGKILL)
        proc.communicate()


def _cmdline(pid: str) -> str:
    """Process ``pid``'s command line ('' once it has gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_demo_link_without_root_says_so() -> None:
    if os.geteuid() == 0:
        pytest.skip("running as root: the link can be made")
    out = run("demo", "--link", "1gbit")
    assert out.returncode == 2 and "needs root" in out.stderr and not out.stdout


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
        # the A/A ratio: the reference's second call over its first, with its interval
        assert r["again_us"] > 0 and r["a/a"] == r["again_us"] / r["torch_us"], r
        lo, hi = r["a/a 90%"]
        assert 0 < lo <= hi, r


def test_bench_ops_rejects_unknown_op() -> None:
    out = run("bench", "ops", "--op", "allreduce")
    assert out.returncode == 2 and "choose from" in out.stderr and not out.stdout


def test_bench_ops_on_one_rank_refuses_or_leaves_out_the_exchanges() -> None:
    # a rank cannot send to itself: gloo failed with "Pair is not connected", MPI exited 1
    out = run("bench", "ops", "--world-size", "1", "--op", "sendrecv", "--sizes", "4")
    assert out.returncode == 2 and "--op sendrecv needs a peer" in out.stderr, out.stderr
    out = run("bench", "ops", "--world-size", "1", "--sizes", "4", "--iters", "2", "--json")
    assert out.returncode == 0, out.stderr
    assert "sendrecv and isend-irecv left out" in out.stderr, out.stderr
    ops = {r["op"] for r in json.loads(out.stdout)}
    assert not {"sendrecv", "isend-irecv"} & ops and "all_reduce" in ops, ops
    out = run("bench", "ops", "--world-size", "1", "--op", "isend-irecv", "--sizes", "4")
    assert out.returncode == 2 and "--op isend-irecv needs a peer" in out.stderr, out.stderr


def test_readme_quick_start_runs_alone_and_on_two_ranks(tmp_path: Path) -> None:
    """The README's first code block, as a newcomer pastes it (before, its isend to rank 1
    failed on one rank, and on rank 1 of two: "dst=1 is this rank")."""
    text = (ROOT / "README.md").read_text()
    start = text.index("```python", text.index("## Quick start")) + len("```python")
    script = tmp_path / "quick_start.py"
    script.write_text(text[start : text.index("```", start)])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    torchrun = ["-m", "torch.distributed.run", "--nproc-per-node", "2"]
    torchrun += ["--log-dir", str(tmp_path / "logs")]  # else a /tmp/torchelastic_* stays
    for launch in ([], [*torchrun, "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"]):
        out = subprocess.run(
            [sys.executable, *launch, str(script)],
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
            cwd=tmp_path,
        )
        assert out.returncode == 0, (launch, out.stdout + out.stderr)


def test_torchrun_example() -> None:
    from tests.gloo.test_examples import _torchrun  # the suite's torchrun of an example

    out = _torchrun("examples/async_allreduce.py")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "averaged over 2 ranks: [0.5, 1.5, 2.5, 3.5]" in out.stdout


def test_bench_lm_trains_and_counts_bytes(tmp_path: Path) -> None:
    """A few steps of the language-model benchmark: losses fall, 1-bit Adam sends far fewer
    bytes after its freeze than in warm-up, and the plot is written."""
    png = tmp_path / "lm.png"
    out = run(
        "bench",
        "lm",
        "--steps",
        "12",
        "--freeze-step",
        "4",
        "--variant",
        "ddp-adamw",
        "--variant",
        "overlap-onebitadam",
        "--variant",
        "diloco-stream-h4",
        "--plot",
        str(png),
        "--json",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads(out.stdout)}
    for r in rows.values():
        assert r["train_loss"][-1] < r["train_loss"][0] and r["held_out_loss"] < 5.5
    # streaming DiLoCo's agreed (global) weights are evaluated too, and differ from the
    # local ones (each rank trained on after its fragments' last landings)
    ds = rows["diloco-stream-h4"]
    assert ds["held_out_loss_global"] < 5.5 and ds["held_out_loss_global"] != ds["held_out_loss"]
    ob = rows["overlap-onebitadam"]
    assert ob["bytes_after_freeze_step"] * 16 < ob["bytes_warmup_step"]
    assert ob["bytes_warmup_step"] >= ob["fp32_bytes"]
    assert png.stat().st_size > 10_000


def test_bench_lm_rejects_a_freeze_past_the_end() -> None:
    out = run("bench", "lm", "--steps", "10", "--freeze-step", "10")
    assert out.returncode == 2 and "--freeze-step 10" in out.stderr


def test_bench_train_reports_where_the_time_went_and_passes_its_options_on() -> None:
    """One run of three variants (one world: each run costs about 15 s of start-up).

    The JSON rows say where a step's time went: forward + backward, the training thread's
    CPU, the whole rank's CPU (a superset of the training thread's, step by step), the
    scheduler worker's CPU per step and the last step's bucket timeline. --pin-heap reaches
    the ranks (they read glibc's thresholds from the environment they start with), and so
    do --diloco-fragments, --diloco-sync-every, --threads, --diloco-pass-thread and
    --diloco-background (0 of
    them is refused: test_bad_counts_and_sizes_...)."""
    out = run(
        "bench", "train", "--variant", "compute", "--variant", "overlap-onebit", "--variant",
        "diloco-streaming", "--model-size", "0.05", "--steps", "2", "--warmup", "1",
        "--pin-heap", "--diloco-fragments", "1", "--threads", "2", "--diloco-pass-thread", "on",
        "--diloco-sync-every", "3", "--diloco-background", "on", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    compute, onebit, diloco = json.loads(out.stdout)
    assert [compute["variant"], onebit["variant"], diloco["variant"]] == [
        "compute", "overlap-onebit", "diloco-streaming",
    ]  # fmt: skip
    for row in (compute, onebit, diloco):
        assert 0 < row["backward_ms"] <= row["step_ms"] and row["train_cpu_ms"] > 0, row
        assert row["rank_cpu_ms"] >= row["train_cpu_ms"], row
        assert row["heap_pinned"] is True, row
        assert row["threads"] == 2, row
    assert "worker_cpu_ms" not in compute and "buckets_ms" not in compute
    assert onebit["worker_cpu_ms"] > 0, onebit
    assert onebit["buckets_ms"], onebit
    for index, ready, start, end in onebit["buckets_ms"]:
        assert isinstance(index, int) and 0 <= ready <= start <= end, onebit["buckets_ms"]
    assert diloco["fragments"] == 1, diloco  # the default, 8, gives 2 here (one per tensor)
    assert (diloco["sync_every"], diloco["delay"]) == (3, 1), diloco  # delay: H // 2
    # DiLoCo.step()'s share of a step, and of that the wait for landings
    assert 0 <= diloco["diloco_wait_ms"] <= diloco["diloco_step_ms"] <= diloco["step_ms"]
    assert 0 <= diloco["diloco_wait_max_ms"] <= diloco["diloco_step_max_ms"], diloco
    assert "diloco_step_ms" not in compute and "diloco_step_ms" not in onebit
    # --diloco-pass-thread reaches the ranks; the inner steps' wait for the passes
    assert diloco["diloco_pass_thread"] is True and diloco["diloco_pass_wait_ms"] >= 0, diloco
    assert diloco["diloco_background"] is True, diloco  # --diloco-background too
    assert diloco["diloco_late"] is False, diloco  # 3 steps: no cycle of landings waited
    # compute-only warms up again before its second half, as DiLoCo's run did at its start
    assert (compute["rewarm_steps"], diloco["rewarm_steps"], onebit["rewarm_steps"]) == (1, 0, 0)
    # DiLoCo's own model stepped without it, around its run: the reference of like tensors
    assert 0 < diloco["own_compute_ms"] <= diloco["own_compute_max_ms"], diloco
    assert "own_compute_ms" not in compute and "own_compute_ms" not in onebit


def test_bad_counts_and_sizes_get_a_usage_error_not_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Before, --sizes abc and --world-size 0 ended in a traceback, --iters 0 in a table of
    NaNs; now argparse names the argument and the problem (exit 2, nothing on stdout).

    The first case runs the command as a user does (its own process); the rest call
    ``overlap.cli.main`` in this process, where a traceback would be an exception raised
    here (each process costs about 2.5 s of torch import: 44 s for them all)."""
    out = run("bench", "ops", "--sizes", "4,abc", timeout=60)
    assert out.returncode == 2 and "argument --sizes: cannot read size 'abc'" in out.stderr
    assert "Traceback" not in out.stderr and not out.stdout, out.stderr
    for args, says in (
        (["bench", "ops", "--sizes", "4,abc"], "argument --sizes: cannot read size 'abc'"),
        (["bench", "ops", "--iters", "0"], "argument --iters: must be at least 1, got 0"),
        (["demo", "--world-size", "0"], "argument --world-size: must be at least 1, got 0"),
        (["bench", "lm", "--steps", "x"], "argument --steps: 'x' is not an integer"),
        # before: a traceback from inside the run (bench train), or tc's own error
        (
            ["bench", "train", "--link", "1xbit"],
            "argument --link: --link takes a positive tc rate such as 10gbit, 1gbit or "
            "100mbit, got '1xbit'",
        ),
        (["bench", "ops", "--link", "0gbit"], "got '0gbit'"),
        (["demo", "--link", "fast"], "got 'fast' (or auto, none, loopback)"),
        # before: the out-of-memory killer stopped a rank, then torchrun's tracebacks
        (
            ["bench", "train", "--world-size", "2000", "--steps", "1"],
            "overlap bench train: these 2000 ranks would need about ",
        ),
        (["demo", "--world-size", "2000"], "overlap demo: these 2000 ranks would need about "),
        (
            ["bench", "ops", "--sizes", "4096GiB"],
            "overlap bench ops: these 2 ranks would need about ",
        ),
        # before: --model-size 0 or -3 trained a 4.2M model, nan and inf were tracebacks,
        # --lr nan failed inside every rank, --device gpu and --allreduce-size foo were
        # tracebacks
        (["bench", "train", "--model-size", "0"], "must be a finite number above 0, got 0"),
        (["bench", "train", "--model-size", "nan"], "must be a finite number above 0, got nan"),
        (["bench", "lm", "--lr", "nan"], "argument --lr: must be a finite number above 0"),
        (["bench", "compress", "--device", "gpu"], "invalid choice: 'gpu'"),
        (["bench", "compress", "--allreduce-size", "foo"], "cannot read size 'foo'"),
        # before: matplotlib's traceback after the whole run, or '-o /tmp' wrote /tmp.png
        (["bench", "train", "--plot", "/nonexistent/x.png"], "create /nonexistent first"),
        (["bench", "lm", "--plot-time", "/tmp"], "'/tmp' is a directory; give a file name"),
        (
            ["bench", "train", "--variant", "diloco-streaming", "--diloco-fragments", "0"],
            "--diloco-fragments: must be at least 1, got 0",
        ),
        (["bench", "train", "--threads", "0"], "--threads: must be at least 1, got 0"),
        (["bench", "train", "--diloco-sync-every", "0"], "--diloco-sync-every: must be at least 1"),
        (["bench", "ops", "--job-timeout", "0"], "--job-timeout: must be a finite number above 0"),
        (["bench", "ops", "--job-timeout", "5"], "--job-timeout is for --backend mpi"),
        # before: the ring benchmark ran gloo ranks under --backend mpi, saying nothing
        (
            ["bench", "ops", "--algorithm", "ring", "--backend", "mpi"],
            "--algorithm ring runs on gloo ranks; drop --backend mpi",
        ),
    ):
        assert_cli_refuses(capsys, args, says)


def test_bench_tables_round_their_floats() -> None:
    from overlap.bench.harness import Table

    t = Table(["variant", "step ms", "ratio"])
    t.add(**{"variant": "ddp", "step ms": 213.4898899998916, "ratio": 1.0512345})
    assert "| ddp | 213 | 1.05 |" in t.markdown()
    assert "213.48" not in t.render() and "1.05" in t.render()


def test_bench_ops_concurrent_runs_and_refuses_bad_counts() -> None:
    out = run("bench", "ops", "--concurrent", "50", "--iters", "1", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads(out.stdout)
    assert [r["order"] for r in rows] == ["together", "last first"]
    assert all(r["in_flight"] == 50 and r["ours_s"] > 0 and r["raw_s"] > 0 for r in rows)
    bad = run("bench", "ops", "--concurrent", "lots")
    assert bad.returncode == 2 and "--concurrent takes counts" in bad.stderr


@pytest.mark.parametrize("moment", ["overlap.cli", "overlap.bench.train", "forkserver"])
def test_ctrl_c_while_a_benchmark_starts_prints_no_traceback(moment: str) -> None:
    """Ctrl-C while the CLI itself imports torch (``overlap.cli``, its first second), while
    the benchmark's child does (``overlap.bench.train``), or while the fork server its ranks
    come from preloads overlap (``forkserver``): one line, exit 130, nothing left. Before
    (fifty-seventh session) each printed its KeyboardInterrupt's traceback through torch's
    imports under the CLI's line: the child's own catch came after its imports, and the
    fork server ignores SIGINT only once it has preloaded; the CLI's own (fifty-eighth
    session) came from ``import overlap``, before any of its code ran."""
    import signal
    import time

    proc = _foreground_job("bench", "train", "--variant", "compute", "--steps", "1000")

    def group() -> list[str]:
        return _group(proc.pid)

    def started() -> bool:
        out = subprocess.run(["pgrep", "-g", str(proc.pid), "-f", moment], capture_output=True)
        return bool(out.stdout.split())

    try:
        assert until(started, 60, every=0.02), f"no {moment} process"
        time.sleep(0.3)  # inside its imports (1.5-2 s here; the CLI's own start 0.1 s)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, (proc.returncode, err[-2000:])
        assert err.strip() == "overlap: interrupted", err[-3000:]
        assert until(lambda: not group(), 15, every=0.2), group()
    finally:
        if proc.poll() is None or group():
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


# commands whose ranks run long enough to be stopped while they run
_LONG_RUNS = pytest.mark.parametrize(
    "args",
    [
        ["bench", "ops", "--op", "all_reduce", "--sizes", "4", "--iters", "1000000"],
        ["bench", "train", "--variant", "compute", "--steps", "1000", "--warmup", "1"],
    ],
    ids=["bench-ops", "bench-train"],
)


@_LONG_RUNS
def test_ctrl_c_ends_a_command_with_a_line_and_leaves_nothing_running(args: list[str]) -> None:
    """Ctrl-C (SIGINT to the terminal's process group) while the ranks run: exit 130 with
    one line, not a Python traceback, no process of the group left behind, and no
    multiprocessing folder left in the temporary directory (a child killed in its own
    clean-up left one)."""
    import glob
    import signal
    import tempfile
    import time

    def folders() -> set[str]:
        return set(glob.glob(os.path.join(tempfile.gettempdir(), "pymp-*")))

    before = folders()

    proc = _foreground_job(*args)

    def group() -> list[str]:
        return _group(proc.pid)

    try:
        until(lambda: len(group()) >= 4, 120, every=0.2)  # the ranks have started
        time.sleep(2.0)  # and run their loop
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, (proc.returncode, err[-2000:])
        assert "overlap: interrupted" in err and "Traceback" not in err, err[-2000:]
        until(lambda: not (group() or folders() - before), 15, every=0.2)
        assert group() == []
        assert folders() - before == set()
    finally:
        if proc.poll() is None or group():
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


@_LONG_RUNS
def test_kill_of_the_cli_alone_ends_everything_at_once(args: list[str]) -> None:
    """SIGTERM to the CLI's process alone (``kill``, a job scheduler): exit 143 within
    seconds, no process of its group left, no multiprocessing folder left. Before
    (fifty-seventh session) the CLI, or its benchmark child, died at once and left its
    ``pymp-*`` folder; once it ran its clean-up, it waited 10-20 s on children and ranks
    that had got no signal (a polite stop the busy ranks never read, the Ctrl-C grace)."""
    import glob
    import signal
    import tempfile
    import time

    def folders() -> set[str]:
        return set(glob.glob(os.path.join(tempfile.gettempdir(), "pymp-*")))

    before = folders()
    proc = _foreground_job(*args)
    try:
        until(lambda: len(_group(proc.pid)) >= 4, 120, every=0.2)  # the ranks have started
        time.sleep(2.0)  # and run their loop
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 143, (proc.returncode, err[-2000:])
        assert time.monotonic() - t0 < 5.0
        assert until(lambda: not (_group(proc.pid) or folders() - before), 15, every=0.2)
        assert "Traceback" not in err, err[-2000:]
    finally:
        if proc.poll() is None or _group(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def test_a_closed_pipe_ends_the_command_as_a_shell_tool_ends() -> None:
    """``overlap env | head -0``: the reader is gone before the first line, and the command
    ends with 141 (128 + SIGPIPE) and no traceback. Before (fifty-eighth session) it printed
    a BrokenPipeError's traceback."""
    proc = subprocess.Popen(
        [*OVERLAP, "env"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141, err[-2000:]
    assert err == ""


def _foreground_job(*args: str) -> subprocess.Popen[str]:
    """``overlap args`` in a process group of its own, as a terminal's foreground job (a
    Ctrl-C is SIGINT to that group)."""
    return subprocess.Popen(
        [*OVERLAP, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )


def _group(pgid: int) -> list[str]:
    """The processes of process group ``pgid``."""
    out = subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True)
    return out.stdout.split()
