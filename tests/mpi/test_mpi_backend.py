"""The MPI backend under real mpiexec with 2 and 3 ranks: every op and contract, bad input."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from tests.gloo.test_bad_input import EXPECTED
from tests.mpi.conftest import MPIEXEC, ROOT, clean_env, mpiexec, needs_mpiexec
from tests.polling import until

pytestmark = [pytest.mark.mpi, needs_mpiexec]

_runs: dict[int, list[dict[str, Any]]] = {}


def run_all(n: int) -> list[dict[str, Any]]:
    """All checks of tests/mpi/run_cases.py in one mpiexec launch of n ranks (cached)."""
    if n not in _runs:
        out = mpiexec(n, "-m", "tests.mpi.run_cases", "mpi")
        results = [
            json.loads(line[7:]) for line in out.stdout.splitlines() if line.startswith("RESULT ")
        ]
        assert out.returncode == 0 and len(results) == n, out.stdout[-3000:] + out.stderr[-12000:]
        _runs[n] = sorted(results, key=lambda d: d["rank"])
    return _runs[n]


@pytest.mark.parametrize("n", [2, 3])
def test_every_op_and_contract_on_mpi(n: int) -> None:
    results = run_all(n)
    failures = {
        (d["rank"], k): v
        for d in results
        for k, v in d.items()
        if isinstance(v, str) and v not in ("ok", "mpi")
    }
    assert not failures, "\n".join(f"rank {r} {k}:\n{v}" for (r, k), v in failures.items())
    names = [k for k, v in results[0].items() if v == "ok"]
    assert len(names) >= 60  # 14 op cases x 4 modes, plus contract and MPI-specific checks
    from tests.gloo import ds_comm_cases

    assert {f"ds_comm/{k}" for k in ds_comm_cases.CHECKS} <= set(names)  # deepspeed.comm's
    from tests.gloo import state_broadcast_cases

    assert {f"state_broadcast/{k}" for k in state_broadcast_cases.CHECKS} <= set(names)
    assert all(d["backend"] == "mpi" and d["world"] == n for d in results)
    if n == 2:  # the two-rank checks ran too
        two = {"in_flight_writes", "raising_callbacks", "loops_are_freed", "diloco/late_landings"}
        assert two <= set(names)


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_bad_input_on_mpi_matches_gloo(case: str) -> None:
    kind, pattern = EXPECTED[case]
    pattern = pattern.replace("gloo backend", "mpi backend").replace(
        "backend 'gloo'", "backend 'mpi'"
    )
    checked = 0
    for d in run_all(3):
        got_kind, msg = d["bad_input"][case]
        if got_kind == "skip":
            continue
        assert got_kind == kind, f"rank {d['rank']}: {got_kind}: {msg}"
        assert re.search(pattern, msg), f"rank {d['rank']}: {msg!r} !~ {pattern!r}"
        checked += 1
    assert checked >= 1


def _python(code: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = clean_env()
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )


def test_outside_mpiexec_runs_as_a_single_rank() -> None:
    out = _python(
        """
        import torch, overlap
        from overlap import comm
        overlap.init_distributed("mpi")
        t = torch.arange(3.)
        async def main():
            return await comm.all_reduce(t, async_op=True)
        out = overlap.run(main()).tolist()
        print(comm.get_backend(), comm.get_rank(), comm.get_world_size(), out)
        """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "mpi 0 1 [0.0, 1.0, 2.0]"


def test_mpi_backend_without_mpi4py_names_the_extra() -> None:
    out = _python(
        """
        import sys, overlap
        sys.modules["mpi4py"] = None
        try:
            overlap.init_distributed("mpi")
        except ImportError as e:
            print("ERR", e)
        """
    )
    assert "ERR dist_backend='mpi' needs mpi4py: pip install overlap[mpi]" in out.stdout, (
        out.stdout + out.stderr
    )


MPI_SET_UP = {
    "serialized": 'mpi4py.rc.thread_level = "serialized"',
    "single": 'mpi4py.rc.thread_level = "single"',
    "not initialised": "mpi4py.rc.initialize = False",
    "finalised": "from mpi4py import MPI; MPI.Finalize()",
}
MPI_REFUSAL = {
    "serialized": "MPI runs with MPI_THREAD_SERIALIZED, but overlap calls MPI from more than "
    "one thread",
    "single": "MPI runs with MPI_THREAD_SINGLE",
    "not initialised": "MPI is not initialised (mpi4py.rc.initialize is False",
    "finalised": "MPI was already finalised in this process",
}


@pytest.mark.parametrize("case", list(MPI_SET_UP))
def test_an_mpi_overlap_cannot_use_is_refused_with_the_fix(case: str) -> None:
    """Below MPI_THREAD_MULTIPLE, overlap's threads (the scheduler's worker, the reaper) and
    the training thread in MPI at once corrupt MPICH's state: two threads of overlap ops
    segfaulted or aborted in 4 runs of 4 (forty-eighth session). An MPI not initialised or
    already finalised ended the process from inside MPICH. Each is a RuntimeError at
    init_distributed now, before any MPI call, naming the fix."""
    out = _python(
        f"""
        import mpi4py
        {MPI_SET_UP[case]}
        import overlap
        try:
            overlap.init_distributed("mpi")
            print("no error")
        except RuntimeError as e:
            print("ERR", e)
        """
    )
    assert f"ERR init_distributed(dist_backend='mpi'): {MPI_REFUSAL[case]}" in out.stdout, (
        out.stdout + out.stderr
    )
    if case in ("serialized", "single"):
        assert f"mpi4py.rc.thread_level is '{case}' here" in out.stdout


WORLD_CASES = {
    # name: (environment, init_distributed's arguments, the start of the error or "ok")
    "torchrun's RANK and WORLD_SIZE": (
        {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"},
        "",
        "init_distributed('mpi'): this process was started with RANK=1 and WORLD_SIZE=2",
    ),
    "world_size given": ({}, "world_size=2", "init_distributed('mpi', world_size=2) but MPI"),
    "rank given": ({}, "rank=1", "init_distributed('mpi', rank=1) but MPI's world has 1 rank"),
    "agreeing": ({"RANK": "0", "WORLD_SIZE": "1"}, "rank=0, world_size=1", "ok 0 1"),
}


@pytest.mark.parametrize("case", list(WORLD_CASES))
def test_mpi_refuses_a_world_that_contradicts_mpis(case: str) -> None:
    """Under torchrun, init_distributed("mpi") made every process an MPI singleton: each ran
    as rank 0 of 1 and trained on its own, silently (forty-eighth session); rank= and
    world_size= that contradicted MPI's were ignored. Both are ValueErrors now."""
    env, args, want = WORLD_CASES[case]
    out = _python(
        f"""
        import overlap
        from overlap import comm
        try:
            overlap.init_distributed("mpi", {args})
            print("ok", comm.get_rank(), comm.get_world_size())
        except ValueError as e:
            print("ERR", e)
        """,
        env,
    )
    assert out.stdout.startswith(want if want.startswith("ok") else f"ERR {want}"), (
        out.stdout + out.stderr
    )


def test_mpi_refuses_a_launchers_rank_that_contradicts_mpiexecs() -> None:
    """RANK and WORLD_SIZE left in the environment of an mpiexec job, naming another job:
    every rank refuses (one of the two is wrong, and code that reads RANK would shard its
    data by the other)."""
    # one write per line: where PYTHONUNBUFFERED is set (this machine sets it) print() writes
    # 'ERR', ' ', the message and the newline apart, and the two ranks' pieces interleaved
    # ("ERRERR init_distributed(...)", 1 job in 30 here)
    code = (
        "import sys, overlap\n"
        "try:\n"
        "    overlap.init_distributed('mpi'); sys.stdout.write('no error\\n')\n"
        "except ValueError as e:\n"
        "    sys.stdout.write(f'ERR {e}\\n')\n"
    )
    out = mpiexec(2, "-c", code, timeout=120, env_extra={"RANK": "5", "WORLD_SIZE": "9"})
    lines = [x for x in out.stdout.splitlines() if x.strip()]
    want = "ERR init_distributed('mpi'): the environment says RANK=5 and WORLD_SIZE=9 but MPI"
    assert len(lines) == 2 and all(x.startswith(want) for x in lines), out.stdout + out.stderr


PEER_EXITS = """
import asyncio, os, sys, time, torch, overlap
from overlap import comm
overlap.init_distributed("mpi")
if comm.get_rank() == 1:
    comm.barrier()
    os._exit(3)                      # dies while rank 0 awaits a message from it
comm.barrier()
async def main():
    try:
        await asyncio.wait_for(comm.irecv(torch.zeros(1), src=1), 10)
        return "received"
    except asyncio.TimeoutError:
        return "timeout"
    except overlap.CommError as e:
        return "CommError"
t0 = time.monotonic()
sys.stdout.write(f"RANK0 {overlap.run(main())} after {time.monotonic() - t0:.1f}s\\n")
sys.stdout.flush()
os._exit(0)
"""


def test_peer_exiting_mid_operation_is_never_a_silent_hang(tmp_path: Path) -> None:
    script = tmp_path / "peer_exits.py"
    script.write_text(PEER_EXITS)
    t0 = time.monotonic()
    out = mpiexec(2, str(script), timeout=120)
    took = time.monotonic() - t0
    # Either rank 0 gets a timeout or an error at its await, or mpiexec tears the job down
    # because a rank died; both within seconds, never a hang.
    said = re.search(r"RANK0 (timeout|CommError)", out.stdout)
    torn_down = "BAD TERMINATION" in out.stdout + out.stderr or out.returncode != 0
    assert said or torn_down, out.stdout + out.stderr
    assert took < 60


@pytest.mark.parametrize("where", ["collective", "blocking", "compressed", "bucket", "sendrecv"])
def test_peer_death_gives_comm_error_within_the_job_timeout(where: str) -> None:
    """With Hydra's auto-cleanup off the survivor stays up: it must raise CommError within
    the configured timeout + 5 s, then exit by itself (no MPI_Finalize hang). The
    collective is an all_reduce seen before (its ready call: awaited, and blocking); the
    sendrecv an exchange seen before (its two stages under the job timeout)."""
    from tests.mpi.conftest import MPIEXEC

    assert MPIEXEC is not None
    t0 = time.monotonic()
    out = subprocess.run(
        [
            MPIEXEC,
            "-disable-auto-cleanup",
            "-n",
            "2",
            sys.executable,
            "tests/mpi/peer_death.py",
            where,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
        cwd=ROOT,
    )
    took = time.monotonic() - t0
    m = re.search(rf"RANK0 {where} CommError \w+ after ([\d.]+)s", out.stdout)
    assert m, out.stdout + out.stderr
    assert float(m.group(1)) < 5.0 + 5
    assert took < 60, took  # both processes are gone: nothing hung at exit


@pytest.mark.parametrize("job_timeout", [None, 30])
def test_ready_calls_make_exactly_the_full_paths_call(job_timeout: int | None) -> None:
    """A repeated all_reduce, broadcast, isend or irecv takes the ready-call path
    (mpi_backend), with or without a job timeout: it must give the same results, blocking,
    waited and awaited, and must not be taken by a non-contiguous view at the same address,
    another op or dtype, or a destroyed group."""
    extra = [] if job_timeout is None else [str(job_timeout)]
    out = mpiexec(2, "-m", "tests.mpi.ready_calls", *extra, timeout=120)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("READY")]
    assert lines == ["READY ok", "READY ok"], out.stdout + out.stderr


def test_an_error_on_one_rank_stops_every_rank_on_mpi() -> None:
    """The one-rank-failure cases of tests/gloo (a scheduler's bucket, before its first
    collective and between its two; an async multi-phase op) on MPI: the failing rank
    raises its error, its peer CommError at the 5 s job timeout, later steps and ops
    OutOfStepError; no wrong result, and the processes exit. And when every rank fails
    alike, every rank stops at once."""
    t0 = time.monotonic()
    out = mpiexec(2, "-m", "tests.mpi.out_of_step", timeout=120)
    lines = [line[7:] for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and len(lines) == 1, out.stdout[-3000:] + out.stderr[-12000:]
    results = json.loads(lines[0])
    for where in ("start", "between"):
        assert results[0][where] == ["ok", "RuntimeError", "OutOfStepError", "OutOfStepError"]
        assert results[1][where] == ["ok", "CommError", "OutOfStepError", "OutOfStepError"]
    stopped = ["OutOfStepError", "OutOfStepError"]
    assert results[0]["driver"] == ["ValueError", "RuntimeError", *stopped]
    assert results[1]["driver"] == ["ValueError", "CommError", *stopped]
    # every rank failing alike: every rank stops at once (before, a rank could wait in the
    # step's vote until the job's timeout, which MPI has none of by default)
    for trial in zip(results[0]["alike"], results[1]["alike"], strict=True):
        kinds = [kind for kind, _ in trial]
        assert "TypeError" in kinds and set(kinds) <= {"TypeError", "CommError"}, results
        assert max(seconds for _, seconds in trial) < 2.5, results
    assert time.monotonic() - t0 < 90


@pytest.mark.parametrize("how", ["raise", "sigint"])
def test_an_uncaught_exception_on_one_rank_ends_the_job(how: str) -> None:
    """Regression: with no job timeout, a rank that exited with an uncaught exception (or
    Ctrl-C) left its peer waiting in an all_reduce for ever, and itself hung in
    MPI_Finalize: the job never ended. Now that rank aborts the job (as python -m mpi4py
    does). The launcher runs in a session of its own, killed whole if it ever hangs."""
    assert MPIEXEC is not None
    proc = subprocess.Popen(
        [MPIEXEC, "-n", "2", sys.executable, "-m", "tests.mpi.uncaught", how],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env(),
        cwd=ROOT, start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the job did not end within 60 s:\n{out[-3000:]}")
    assert proc.returncode != 0, out
    assert "rank 1 exits with an uncaught" in out and "aborting the MPI job" in out, out
    assert "rank 0 was not stopped" not in out, out


def test_ctrl_c_of_the_mpi_bench_ends_the_job_at_once_and_quietly() -> None:
    """Ctrl-C (SIGINT to the terminal's process group) while ``overlap bench ops --backend
    mpi`` runs: the job ends within seconds, with ``overlap: interrupted`` alone, and
    nothing of MPICH's is left. Before (fifty-seventh session) the benchmark's
    ranks caught the interrupt and exited: one hung in MPI_Finalize while its peer sat in
    MPI's own Wait, until the CLI's 20 s grace ran out and it sent SIGTERM. The abort
    leaves a topology file in /tmp and a 2 MiB segment in /dev/shm, which the CLI removes."""
    from overlap.bench.stopping import _hydra_files, _mpich_segments

    before = _hydra_files() | _mpich_segments()
    proc = subprocess.Popen(
        [sys.executable, "-m", "overlap.cli", "bench", "ops", "--backend", "mpi", "--op",
         "all_reduce", "--op", "sendrecv", "--sizes", "8", "--iters", "100000000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
        cwd=ROOT, start_new_session=True,
    )  # fmt: skip

    def ranks() -> list[str]:
        out = subprocess.run(["pgrep", "-f", "overlap.bench.ops"], capture_output=True, text=True)
        return out.stdout.split()

    try:
        assert until(lambda: len(ranks()) >= 2, 60, every=0.1), "the ranks did not start"
        time.sleep(6.0)  # past their imports: in the timed loop
        os.killpg(proc.pid, signal.SIGINT)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
        assert proc.returncode == 130, (proc.returncode, err[-3000:])
        assert err.strip() == "overlap: interrupted", err[-3000:]
        assert took < 15, f"the job took {took:.1f} s to end"
        assert until(lambda: not ranks(), 10), ranks()
        assert (_hydra_files() | _mpich_segments()) - before == set()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def test_bench_ops_on_mpi_with_a_job_timeout() -> None:
    """``overlap bench ops --backend mpi --job-timeout S`` runs the ranks under mpiexec with
    that job timeout (the ready calls then carry a deadline) and reports every method."""
    out = subprocess.run(
        [sys.executable, "-m", "overlap.cli", "bench", "ops", "--backend", "mpi", "--op",
         "all_reduce", "--op", "all_gather", "--op", "sendrecv", "--sizes", "8", "--iters",
         "20", "--warmup", "2", "--job-timeout", "30", "--json"],
        capture_output=True, text=True, timeout=120, env=clean_env(), cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads(out.stdout)
    assert [(r["op"], r["bytes"]) for r in rows] == [
        ("all_reduce", 8),
        ("all_gather", 8),
        ("sendrecv", 8),
    ]
    for r in rows:
        assert min(r["torch_us"], r["blocking_us"], r["wait_us"], r["await_us"]) > 0, r
        assert r["job_timeout_s"] == 30.0, r  # the timeout the ranks' backend held
        for ratio in ("await/torch", "blocking/torch", "a/a"):  # rank 0's intervals
            lo, hi = r[f"{ratio} 90%"]
            assert 0 < lo <= hi, r


def test_sub_groups_of_a_four_rank_job_on_mpi() -> None:
    # a BucketScheduler per data-parallel group, hierarchical DiLoCo, and a grid's groups
    # under a DiLoCo, async ring and 1-bit reductions (the gloo tests' checks, on MPI)
    out = mpiexec(4, "-m", "tests.mpi.run_cases", "mpi", "--only", "four")
    results = [json.loads(x[7:]) for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert out.returncode == 0 and len(results) == 4, out.stdout[-3000:] + out.stderr[-6000:]
    from tests.mpi.run_cases import FOUR_RANKS

    for d in results:
        for name in FOUR_RANKS:
            assert d[name] == "ok", f"rank {d['rank']} {name}:\n{d[name]}"


def test_parameters_go_through_every_op_on_mpi() -> None:
    """nn.Parameter tensors (leaves that require grad) in every op, 5 dtypes, blocking and
    async, twice each: the MPI backend's own in-place writes (AVG's division, a bfloat16
    result copied back, a float max's keys) raised after MPI had summed into the tensor,
    and a reduce failed on its root alone (the others hung until the job timeout); gloo
    detached such tensors all along (forty-eighth session)."""
    out = mpiexec(2, "-m", "tests.mpi.param_cases", "8", timeout=180)
    rows = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert len(rows) == 2, out.stdout + out.stderr[-3000:]
    for row in rows:
        assert row["cases"] == 48 and row["failed"] == [], row
