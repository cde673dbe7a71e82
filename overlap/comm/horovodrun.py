"""Processes started by ``horovodrun`` in its gloo mode (the default of a Horovod built
without MPI): rank and world size from the variables it gives every worker, so a Horovod
user's launch line keeps working for a script moved to overlap.

horovodrun's gloo launcher sets ``HOROVOD_RANK``, ``HOROVOD_SIZE``, ``HOROVOD_LOCAL_RANK``,
``HOROVOD_LOCAL_SIZE``, ``HOROVOD_CROSS_RANK`` and ``HOROVOD_CROSS_SIZE`` (horovod/runner
gloo_run.py). Its rendezvous is Horovod's own HTTP store, which torch.distributed cannot
join, so the master address is ``MASTER_ADDR`` when set (horovodrun passes the launching
shell's environment to every worker: ``MASTER_ADDR=host0 horovodrun ...``) and 127.0.0.1
when every worker runs on one host; a job over several hosts without it is refused with that
fix. (``horovodrun --mpi`` starts the workers with mpirun: MPI discovery finds them.)

Before this module every worker of ``horovodrun -np 4 python train.py`` found no launcher
and trained alone as rank 0 of 1, with no error.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from overlap.comm.launch_vars import launcher_ints

__all__ = ["HorovodPlacement", "horovod_placement"]

_VARS = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE")


@dataclass(frozen=True)
class HorovodPlacement:
    """A horovodrun worker: rank, world size, local rank and size, its host's index, and the
    master address (None: several hosts and no ``MASTER_ADDR``)."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    node: int
    master: str | None


def horovod_placement(env: Mapping[str, str] | None = None) -> HorovodPlacement | None:
    """This worker's placement when horovodrun started it (its four rank variables set),
    else None; ValueError when they contradict each other."""
    env = os.environ if env is None else env
    got = launcher_ints(env, _VARS, "horovodrun")
    if got is None:
        return None
    rank, world, local, local_world = got
    if not 0 <= local < local_world <= world:
        raise ValueError(
            f"HOROVOD_LOCAL_RANK={local} and HOROVOD_LOCAL_SIZE={local_world} do not fit "
            f"HOROVOD_SIZE={world}"
        )
    # the host's index: HOROVOD_CROSS_RANK is the rank among the workers of this local
    # rank, one a host, which is the host's index when the hosts hold as many workers each
    cross = env.get("HOROVOD_CROSS_RANK", "0")
    if not cross.isdigit():
        raise ValueError(f"HOROVOD_CROSS_RANK={cross!r} is not an integer (set by horovodrun)")
    node = int(cross)
    one_host = local_world == world
    master = env.get("MASTER_ADDR") or ("127.0.0.1" if one_host else None)
    return HorovodPlacement(rank, world, local, local_world, node, master)
