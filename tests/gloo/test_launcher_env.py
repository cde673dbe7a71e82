"""Processes started as SLURM's srun or horovodrun (gloo mode) start them join one job with
no torchrun and no MPI (overlap.comm.slurm, overlap.comm.horovodrun); one started by a batch
script itself runs alone and says so. Real processes on this host talking through gloo; the
launcher's part, its environment, is written out as srun(1) and horovodrun's gloo_run.py
set it (tests/hosts runs srun's across two namespace hosts)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from overlap.comm.init import _free_port

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, torch, overlap
    from overlap import comm
    overlap.init_distributed(timeout=60)
    r, w = comm.get_rank(), comm.get_world_size()
    t = torch.tensor([float(r + 1)])
    comm.all_reduce(t)
    place = [r, w, comm.get_local_rank(), comm.get_local_world_size(), comm.get_node_rank()]
    sys.stdout.write("PLACE " + json.dumps(place + [t.item()]) + "\\n")
    comm.destroy_process_group()
    """
)

# what a launcher may have left in this process's environment
LAUNCH = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
          "MASTER_ADDR", "MASTER_PORT", "PMI_RANK", "PMI_SIZE", "PMIX_RANK",
          "OMPI_COMM_WORLD_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")  # fmt: skip


def _clean_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCH and not k.startswith(("SLURM_", "HOROVOD_"))
    }
    env["OMP_NUM_THREADS"] = "1"
    return env


def _place(out: str) -> list[float]:
    lines = [x for x in out.splitlines() if x.startswith("PLACE ")]
    assert len(lines) == 1, out
    import json

    got: list[float] = json.loads(lines[0][6:])
    return got


def _each(
    script: Path, envs: list[dict[str, str]], timeout: float = 120
) -> list[tuple[subprocess.Popen[str], str, str]]:
    """``script`` run once per environment, all at once: (process, stdout, stderr) each."""
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env={**_clean_env(), **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for env in envs
    ]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [(p, out, err) for p, (out, err) in zip(procs, outs, strict=True)]


def _run_all(script: Path, envs: list[dict[str, str]]) -> list[list[float]]:
    ran = _each(script, envs)
    assert [p.returncode for p, _, _ in ran] == [0] * len(envs), [e[-2000:] for _, _, e in ran]
    return [_place(out) for _, out, _ in ran]


def test_srun_tasks_on_one_node_join_one_job(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    step = {
        "SLURM_JOB_ID": "77",
        "SLURM_STEP_ID": "0",
        "SLURM_NTASKS": "3",
        "SLURM_STEP_NUM_TASKS": "3",
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_STEP_TASKS_PER_NODE": "3",
        "SLURM_NODEID": "0",
        "MASTER_PORT": str(_free_port()),
    }
    envs = [{**step, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)} for r in range(3)]
    # rank, world, local rank, local world, node, and the sum 1 + 2 + 3 over the job
    assert _run_all(script, envs) == [[r, 3, r, 3, 0, 6.0] for r in range(3)]


def test_the_deepspeed_launchers_placement_is_read(tmp_path: Path) -> None:
    """DeepSpeed's launcher (deepspeed/launcher/launch.py) gives RANK, LOCAL_RANK, WORLD_SIZE
    and MASTER_* as torchrun does, but the host as CROSS_RANK and its process count as
    LOCAL_SIZE: two "hosts" of two ranks each here, on one machine. Before, every rank said
    host 0 of one (local world size 4)."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    common = {"WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
              "CROSS_SIZE": "2", "LOCAL_SIZE": "2"}  # fmt: skip
    envs = [
        {**common, "RANK": str(r), "LOCAL_RANK": str(r % 2), "CROSS_RANK": str(r // 2)}
        for r in range(4)
    ]
    assert _run_all(script, envs) == [[r, 4, r % 2, 2, r // 2, 10.0] for r in range(4)]


def test_a_job_started_from_srun_variables_by_hand_is_adopted_in_place(tmp_path: Path) -> None:
    """A script that starts torch.distributed itself from SLURM's variables (no torchrun
    variables), then lets overlap adopt the job: every rank said local rank 0 on host 0 of
    one; now srun's placement is read when it names the same rank of a job of that size."""
    script = tmp_path / "job.py"
    own = (
        "import os, torch.distributed as dist\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:' + os.environ['PORT'],"
        " rank=int(os.environ['SLURM_PROCID']),"
        " world_size=int(os.environ['SLURM_STEP_NUM_TASKS']))\n"
    )
    script.write_text(own + SCRIPT)
    step = {"SLURM_JOB_ID": "81", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4",
            "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
            "PORT": str(_free_port())}  # fmt: skip
    envs = [
        {**step, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r % 2), "SLURM_NODEID": str(r // 2)}
        for r in range(4)
    ]
    assert _run_all(script, envs) == [[r, 4, r % 2, 2, r // 2, 10.0] for r in range(4)]


def _horovod(rank: int, size: int = 3, **extra: str) -> dict[str, str]:
    return {
        "HOROVOD_RANK": str(rank),
        "HOROVOD_SIZE": str(size),
        "HOROVOD_LOCAL_RANK": str(rank),
        "HOROVOD_LOCAL_SIZE": str(size),
        "HOROVOD_CROSS_RANK": "0",
        "HOROVOD_CROSS_SIZE": "1",
        "HOROVOD_HOSTNAME": "localhost",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
        "HOROVOD_GLOO_RENDEZVOUS_PORT": "1",
        **extra,
    }


def test_horovodrun_workers_join_one_job_inside_an_srun_step(tmp_path: Path) -> None:
    """``srun -n 1 horovodrun -np 3 python train.py``: the workers see the srun step of one
    task as well; horovodrun, the inner launcher, decides."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    port = str(_free_port())
    outer = {"SLURM_JOB_ID": "79", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0",
             "SLURM_STEP_NUM_TASKS": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
             "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_TASKS_PER_NODE": "1"}  # fmt: skip
    envs = [{**outer, **_horovod(r), "MASTER_PORT": port} for r in range(3)]
    assert _run_all(script, envs) == [[r, 3, r, 3, 0, 6.0] for r in range(3)]


def test_horovodrun_over_several_hosts_needs_a_master(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {**_clean_env(), **_horovod(2, size=4, HOROVOD_LOCAL_RANK="0", HOROVOD_LOCAL_SIZE="2")}
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0
    assert "set MASTER_ADDR to rank 0's host (MASTER_ADDR=host0 horovodrun" in out.stderr


def test_two_one_task_steps_on_a_node_each_run_alone(tmp_path: Path) -> None:
    """Two runs of ``python train.py`` in interactive steps of one task (``srun --pty
    bash``) on one node, at once: each is a single rank on a port of its own (the step's
    derived port would be the same for both, and the second could not listen on it)."""
    script = tmp_path / "job.py"
    script.write_text(
        SCRIPT.replace(
            "comm.destroy_process_group()",
            "comm.barrier()\nimport time; time.sleep(1); comm.destroy_process_group()",
        )
    )
    one = {"SLURM_JOB_ID": "80", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0",
           "SLURM_STEP_NUM_TASKS": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
           "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_TASKS_PER_NODE": "1"}  # fmt: skip
    assert _run_all(script, [one, one]) == [[0, 1, 0, 1, 0, 1.0]] * 2


def test_a_batch_script_without_srun_runs_alone_and_says_so(tmp_path: Path) -> None:
    """Inside an allocation of 4 tasks, a process the batch script starts itself (no srun)
    has no step: it must not wait for 3 peers nobody started, and must not be silent."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    allocation = {"SLURM_JOB_ID": "78", "SLURM_NTASKS": "4", "SLURM_PROCID": "0",
                  "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}  # fmt: skip
    out = subprocess.run(
        [sys.executable, str(script)],
        env={**_clean_env(), **allocation},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert _place(out.stdout) == [0, 1, 0, 1, 0, 1.0]
    assert "SLURM allocation of 4 tasks but was not started by srun" in out.stderr


def test_ranks_started_unlike_each_other_are_refused_at_once(tmp_path: Path) -> None:
    """Two processes started by hand as one job, debug mode on rank 0 only and rank 1 told
    WORLD_SIZE=3: both refuse at init within seconds, naming rank 1 and what differs
    (overlap.comm.handshake). Before (fifty-eighth session), the debug-mode pair met its
    60 s timeout in the first all_reduce and the world-size pair in the rendezvous or the
    first collective, with errors that named neither cause."""
    import time

    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    envs = [
        {**common, "RANK": "0", "WORLD_SIZE": "2", "OVERLAP_DEBUG": "1"},
        {**common, "RANK": "1", "WORLD_SIZE": "3"},
    ]
    t0 = time.monotonic()
    ran = _each(script, envs, timeout=50)
    assert time.monotonic() - t0 < 40.0  # the job's timeout is 60 s
    said = f"rank 1 (pid {ran[1][0].pid}"
    for p, _, err in ran:
        assert p.returncode == 1, err[-2000:]
        last = err.strip().splitlines()[-1]
        assert last.startswith("ValueError: init_distributed: the processes at this"), last
        assert said in last and "WORLD_SIZE 3 where rank 0 has 2" in last, last
        assert "debug mode (OVERLAP_DEBUG or init_distributed(debug=)) False" in last, last
