"""SLURM's srun environment (overlap.comm.slurm): hostlists, tasks per node, a task's
placement and port, and which launcher init_distributed believes. Pure: no process is
started here (tests/gloo/test_launcher_env.py and tests/hosts start real ones)."""

from __future__ import annotations

import pytest

from overlap.comm import slurm
from overlap.comm.init import _cuda_device, _srun_instead_of_mpi


@pytest.mark.parametrize(
    ("expr", "want"),
    [
        ("node1", ["node1"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("node[08-11]", ["node08", "node09", "node10", "node11"]),
        ("gpu[1-2],cpu7,io[3]", ["gpu1", "gpu2", "cpu7", "io3"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("a-[0-1].cluster", ["a-0.cluster", "a-1.cluster"]),
        (" 10.0.0.1,10.0.0.2 ", ["10.0.0.1", "10.0.0.2"]),
    ],
)
def test_hostlists_expand_as_scontrol_shows_them(expr: str, want: list[str]) -> None:
    assert slurm.expand_hostlist(expr) == want


@pytest.mark.parametrize(
    ("expr", "why"),
    [
        ("", "empty"),
        ("node[1-3", "'\\[' without '\\]'"),
        ("node1-3]", "'\\]' without '\\['"),
        ("node[3-1]", "backwards"),
        ("node[a-b]", "not a number"),
        ("node1,,node2", "empty name"),
    ],
)
def test_a_malformed_hostlist_is_refused(expr: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        slurm.expand_hostlist(expr)


def test_tasks_per_node() -> None:
    assert slurm.tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert slurm.tasks_per_node("4") == [4]
    with pytest.raises(ValueError, match="N or N\\(xM\\)"):
        slurm.tasks_per_node("2(3)")


def _task(rank: int, world: int = 4, per_node: int = 2, **extra: str) -> dict[str, str]:
    return {
        "SLURM_JOB_ID": "1234",
        "SLURM_STEP_ID": "3",
        "SLURM_PROCID": str(rank),
        "SLURM_STEP_NUM_TASKS": str(world),
        "SLURM_LOCALID": str(rank % per_node),
        "SLURM_NODEID": str(rank // per_node),
        "SLURM_STEP_NODELIST": "n[07-08]",
        "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{world // per_node})",
        **extra,
    }


def test_an_srun_task_knows_its_place() -> None:
    got = [slurm.srun_placement(_task(r)) for r in range(4)]
    assert [(p.rank, p.world, p.local_rank, p.local_world, p.node) for p in got if p] == [
        (0, 4, 0, 2, 0), (1, 4, 1, 2, 0), (2, 4, 0, 2, 1), (3, 4, 1, 2, 1)
    ]  # fmt: skip
    assert got[0] is not None and got[0].nodes == ("n07", "n08")
    # uneven nodes: 3 tasks on the first, 1 on the second
    odd = slurm.srun_placement(
        {**_task(3), "SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "3,1"}
    )
    assert odd is not None and (odd.local_rank, odd.local_world, odd.node) == (0, 1, 1)


def test_no_step_no_placement() -> None:
    assert slurm.srun_placement({}) is None
    # a batch script's own shell: the allocation's variables, no step
    batch = {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "8", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    assert slurm.srun_placement(batch) is None
    assert slurm.unlaunched_tasks(batch) == 8
    assert slurm.unlaunched_tasks({**batch, "SLURM_NTASKS": "1"}) is None
    assert slurm.unlaunched_tasks(_task(0)) is None  # srun started it
    assert slurm.unlaunched_tasks({}) is None


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"SLURM_PROCID": "4"}, "outside SLURM_STEP_NUM_TASKS"),
        ({"SLURM_PROCID": "x"}, "SLURM_PROCID='x' is not an integer"),
        ({"SLURM_NODEID": "2"}, "lists 2 nodes"),
        ({"SLURM_LOCALID": "2"}, "outside this node's 2 tasks"),
    ],
)
def test_contradicting_srun_variables_are_refused(change: dict[str, str], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        slurm.srun_placement({**_task(1), **change})


def test_the_port_is_given_or_derived_from_the_job_and_step() -> None:
    assert slurm.srun_port({**_task(0), "MASTER_PORT": "4000"}, 5000) == 4000
    assert slurm.srun_port(_task(0), 5000) == 5000
    port = slurm.srun_port(_task(0))
    assert slurm.PORT_BASE <= port < slurm.PORT_BASE + slurm.PORT_SPAN
    assert slurm.srun_port({**_task(0), "SLURM_STEP_ID": "4"}) != port  # another step
    assert slurm.srun_port({**_task(0), "SLURM_JOB_ID": "1235"}) != port  # another job
    assert slurm.srun_port({}) == 29500


def test_mpi_wins_unless_it_cannot_run_and_srun_describes_the_same_ranks() -> None:
    pmi = {"PMI_RANK": "1", "PMI_SIZE": "4"}
    # srun --mpi=pmi2 without mpi4py: srun's variables name the same ranks
    assert _srun_instead_of_mpi({**_task(1), **pmi}, mpi4py=False)
    assert not _srun_instead_of_mpi({**_task(1), **pmi}, mpi4py=True)  # MPI discovery runs
    # mpiexec inside an allocation: hydra's proxies are the step's tasks (one a node)
    proxies = _task(0, world=2, per_node=1)
    assert not _srun_instead_of_mpi({**proxies, "PMI_RANK": "1", "PMI_SIZE": "4"}, mpi4py=False)
    assert not _srun_instead_of_mpi(pmi, mpi4py=False)  # no srun at all


def test_a_rank_with_one_gpu_of_its_own_takes_device_0() -> None:
    assert _cuda_device(3, 8) == 3
    assert _cuda_device(3, 1) == 0  # srun --gpus-per-task=1
    with pytest.raises(ValueError, match="sees 2 CUDA devices"):
        _cuda_device(3, 2)
