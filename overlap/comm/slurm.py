"""Processes started by SLURM's ``srun``: rank, world size and master address from its
environment, so ``srun python train.py`` needs no torchrun and no MPI.

srun sets, for every task of a job step (srun(1), "OUTPUT ENVIRONMENT VARIABLES"):
``SLURM_PROCID`` (the task's rank in the step), ``SLURM_STEP_NUM_TASKS`` (the step's task
count), ``SLURM_LOCALID`` (the task's index on its node), ``SLURM_NODEID`` (its node's index
in the step), ``SLURM_STEP_NODELIST`` (the step's nodes as a hostlist expression,
``node[01-04,07]``) and ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``).

Only the *step's* variables are read. A batch script that runs ``python train.py`` without
srun sees the allocation's ``SLURM_NTASKS`` (and often ``SLURM_PROCID=0``) but no step of
its own: taking ``SLURM_NTASKS`` as the world size there would make one process wait for
peers that were never started, until the rendezvous timeout. Such a process runs as a single
rank, with a warning that names srun (:func:`unlaunched_tasks`).

Before this module, every task of ``srun python train.py`` (gloo or NCCL) found no launcher
and ran as a single rank of its own: N separate trainings, each on its own data, with no
error (``init_distributed``'s "no launcher environment found").

MPI's variables win over SLURM's: ``mpiexec`` inside an allocation starts its proxies with
srun (hydra's SLURM launcher), one task per node, so the SLURM step variables the ranks
inherit describe the proxies, not the ranks (overlap.comm.init orders the two).

The master is the step's first node (where tasks 0.. run under srun's block and cyclic
distributions); set ``MASTER_ADDR`` when task 0 runs elsewhere (``--distribution=arbitrary``).
The port is ``MASTER_PORT`` when set, else one derived from the job and step IDs (as
Lightning does from the job ID), so two jobs that share a first node do not both take 29500.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from overlap.comm.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
from overlap.comm.launch_vars import launcher_ints, master_port

__all__ = [
    "SrunPlacement",
    "expand_hostlist",
    "srun_placement",
    "srun_port",
    "tasks_per_node",
    "unlaunched_tasks",
]

_STEP_VARS = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_NODEID")
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_REPEAT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")
PORT_BASE, PORT_SPAN = 15000, 10000  # below Linux's ephemeral ports (32768-60999)


@dataclass(frozen=True)
class SrunPlacement:
    """Where this srun task sits: its rank and the step's task count, its index on its node
    and its node's task count, its node's index, and the step's node names."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    node: int
    nodes: tuple[str, ...]


def _split_top(expr: str) -> list[str]:
    """``expr`` split at the commas outside brackets."""
    out, depth, at = [], 0, 0
    for i, ch in enumerate(expr):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"hostlist {expr!r}: ']' without '['")
        elif ch == "," and depth == 0:
            out.append(expr[at:i])
            at = i + 1
    if depth:
        raise ValueError(f"hostlist {expr!r}: '[' without ']'")
    out.append(expr[at:])
    return out


def _expand_one(name: str, whole: str) -> list[str]:
    """One hostlist item (``rack[1-2]-n[01-03]``): every bracket expanded, left to right."""
    start = name.find("[")
    if start < 0:
        if "]" in name:
            raise ValueError(f"hostlist {whole!r}: ']' without '['")
        return [name]
    end = name.index("]", start)
    head, body, tail = name[:start], name[start + 1 : end], name[end + 1 :]
    values: list[str] = []
    for part in body.split(","):
        m = _RANGE.match(part.strip())
        if m is None:
            raise ValueError(f"hostlist {whole!r}: {part!r} is not a number or a range a-b")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"hostlist {whole!r}: the range {part!r} runs backwards")
        width = len(lo)  # node[01-10]: the lower bound's zeros set the width
        values += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    return [f"{head}{v}{rest}" for v in values for rest in _expand_one(tail, whole)]


def expand_hostlist(expr: str) -> list[str]:
    """SLURM's hostlist expression as host names, in order (``scontrol show hostnames``):
    ``"node[01-03,07],gpu1"`` -> ``node01 node02 node03 node07 gpu1``. ValueError for a
    malformed one."""
    expr = expr.strip()
    if not expr:
        raise ValueError("hostlist is empty")
    out: list[str] = []
    for item in _split_top(expr):
        if not item:
            raise ValueError(f"hostlist {expr!r}: an empty name")
        out += _expand_one(item, expr)
    return out


def tasks_per_node(expr: str) -> list[int]:
    """SLURM's tasks-per-node list (``"2(x3),1"``) as one count per node: [2, 2, 2, 1]."""
    out: list[int] = []
    for part in expr.strip().split(","):
        m = _REPEAT.match(part.strip())
        if m is None:
            raise ValueError(f"tasks per node {expr!r}: {part!r} is not N or N(xM)")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def srun_placement(env: Mapping[str, str] | None = None) -> SrunPlacement | None:
    """This task's placement when srun started it (every step variable of the module
    docstring is set), else None. ValueError when they contradict each other."""
    env = os.environ if env is None else env
    got = launcher_ints(env, _STEP_VARS, "srun")
    if got is None:
        return None
    rank, world, local, node = got
    nodes_expr = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
    nodes = tuple(expand_hostlist(nodes_expr)) if nodes_expr else ()
    counts = (
        tasks_per_node(env["SLURM_STEP_TASKS_PER_NODE"])
        if env.get("SLURM_STEP_TASKS_PER_NODE")
        else []
    )
    if counts and not 0 <= node < len(counts):
        raise ValueError(
            f"SLURM_NODEID={node} but SLURM_STEP_TASKS_PER_NODE lists {len(counts)} nodes"
        )
    local_world = counts[node] if counts else world
    if not 0 <= local < local_world:
        raise ValueError(f"SLURM_LOCALID={local} is outside this node's {local_world} tasks")
    return SrunPlacement(rank, world, local, local_world, node, nodes)


def srun_port(env: Mapping[str, str] | None = None, given: int | None = None) -> int:
    """The master port of an srun step: ``MASTER_PORT`` when set, else ``given`` (a port the
    caller chose), else one derived from the job and step IDs (in [15000, 25000)), else
    torch's 29500."""
    env = os.environ if env is None else env
    if env.get("MASTER_PORT"):
        return master_port(env, TORCH_DISTRIBUTED_DEFAULT_PORT, world=2)  # a step of several
    if given is not None:
        return given
    job, step = env.get("SLURM_JOB_ID", ""), env.get("SLURM_STEP_ID", "0")
    if not job.isdigit():
        return TORCH_DISTRIBUTED_DEFAULT_PORT
    return PORT_BASE + (int(job) * 16 + (int(step) if step.isdigit() else 0)) % PORT_SPAN


def unlaunched_tasks(env: Mapping[str, str] | None = None) -> int | None:
    """The allocation's task count when this process runs inside a SLURM allocation of more
    than one task but was not started by srun (a batch script's own shell), else None."""
    env = os.environ if env is None else env
    if "SLURM_JOB_ID" not in env or "SLURM_STEP_NUM_TASKS" in env:
        return None
    try:
        n = int(env.get("SLURM_NTASKS", "1"))
    except ValueError:
        return None
    return n if n > 1 else None
