"""torch.distributed's names that deepspeed.comm lacks: group helpers and queries.

``get_group_rank``, ``get_process_group_ranks``, ``new_subgroups``,
``new_subgroups_by_enumeration``, ``get_node_local_rank`` and the ``is_*_available`` queries
carry torch's names and signatures, so code written for ``torch.distributed`` (FSDP's hybrid
sharding, per-host groups, a backend picked by what is installed) runs on gloo, NCCL and MPI
alike (the ``all_gather_single`` / ``reduce_scatter_single`` aliases are in
:mod:`overlap.comm`). They sit on :func:`overlap.comm.new_group`, so their groups get the
job's timeout, a debug twin, and the non-member object that names the members.

Two differences from torch:

* every subgroup list is checked on every rank *before* the first group is made (torch
  makes groups until it meets a rank listed twice, then raises, and the groups made so far
  stay made, with their connections and threads);
* ``new_subgroups``' default size is the number of processes on this host (torch's is the
  CUDA device count, and it refuses without CUDA): one subgroup per host in both cases when
  each process drives one device.
"""

from __future__ import annotations

import importlib.util
import numbers
import os
from collections.abc import Sequence
from typing import Any

__all__ = [
    "get_group_rank",
    "get_node_local_rank",
    "get_process_group_ranks",
    "is_gloo_available",
    "is_mpi_available",
    "is_nccl_available",
    "is_torchelastic_launched",
    "new_subgroups",
    "new_subgroups_by_enumeration",
]


def get_process_group_ranks(group: Any = None) -> list[int]:
    """The global ranks of ``group``'s members (the world's for None), in group-rank order.

    Known on non-members too (a group's members are the ranks every rank passed to
    ``new_group``), as torch's is for a group it made."""
    from overlap.comm import get_all_ranks_from_group
    from overlap.comm.groups import NonMemberGroup

    if isinstance(group, NonMemberGroup):
        return list(group.ranks)
    return get_all_ranks_from_group(group)


def get_group_rank(group: Any, global_rank: int) -> int:
    """``global_rank``'s rank inside ``group`` (the identity for the world: ``None``).

    Raises ValueError, naming the members, when ``global_rank`` is not one of them."""
    if isinstance(global_rank, bool) or not isinstance(global_rank, numbers.Integral):
        raise TypeError(f"get_group_rank: global_rank must be an int, got {global_rank!r}")
    ranks = get_process_group_ranks(group)
    try:
        return ranks.index(int(global_rank))
    except ValueError:
        raise ValueError(
            f"get_group_rank: global rank {global_rank} is not part of the group of ranks {ranks}"
        ) from None


def new_subgroups_by_enumeration(
    ranks_per_subgroup_list: Sequence[Sequence[int]], **kwargs: Any
) -> tuple[Any, list[Any]]:
    """One group per list of global ranks; returns (this rank's subgroup or None, all of
    them). Every rank calls it with the same lists (torch's rule for ``new_group``).

    A rank in two lists, an empty list or no lists at all raise ValueError on every rank
    before any group is made. ``kwargs`` go to :func:`overlap.comm.new_group` (``timeout``,
    ``pg_options``, ...)."""
    from overlap.comm import get_rank, get_world_size, new_group

    if ranks_per_subgroup_list is None or isinstance(ranks_per_subgroup_list, (str, bytes)):
        raise TypeError(
            "new_subgroups_by_enumeration: ranks_per_subgroup_list must be a list of lists of "
            f"global ranks, got {ranks_per_subgroup_list!r}"
        )
    lists = [list(r) for r in ranks_per_subgroup_list]
    if not lists:
        raise ValueError("new_subgroups_by_enumeration: ranks_per_subgroup_list is empty")
    world = get_world_size()
    owner: dict[int, int] = {}
    for i, ranks in enumerate(lists):
        if not ranks:
            raise ValueError(f"new_subgroups_by_enumeration: subgroup {i} has no ranks")
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, numbers.Integral) or not 0 <= r < world:
                raise ValueError(
                    f"new_subgroups_by_enumeration: {r!r} in subgroup {ranks} is not a global "
                    f"rank of this job (0 to {world - 1})"
                )
            if r in owner:
                raise ValueError(
                    f"new_subgroups_by_enumeration: rank {r} is in both subgroup "
                    f"{lists[owner[r]]} and {ranks}; each rank may be in one subgroup only"
                )
            owner[r] = i
    me = get_rank()
    groups = [new_group(ranks, **kwargs) for ranks in lists]
    mine = groups[owner[me]] if me in owner else None
    return mine, groups


def new_subgroups(
    group_size: int | None = None, group: Any = None, **kwargs: Any
) -> tuple[Any, list[Any]]:
    """Split ``group`` (the world by default) into subgroups of ``group_size`` consecutive
    ranks; returns (this rank's subgroup, all of them). Every rank of the world calls it.

    ``group_size`` defaults to the processes on this host (:func:`get_local_world_size`), so
    each host gets a subgroup. It must be positive and divide the group's size."""
    from overlap.comm import get_local_world_size

    if group_size is None:
        group_size = get_local_world_size()
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral):
        raise TypeError(f"new_subgroups: group_size must be an int, got {group_size!r}")
    ranks = get_process_group_ranks(group)
    if group_size <= 0 or len(ranks) % group_size:
        raise ValueError(
            f"new_subgroups: group_size={group_size} must be positive and divide the group's "
            f"{len(ranks)} ranks"
        )
    size = int(group_size)
    lists = [ranks[i : i + size] for i in range(0, len(ranks), size)]
    return new_subgroups_by_enumeration(lists, **kwargs)


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """This process's rank on its host: LOCAL_RANK when a launcher set it, else the one
    overlap discovered in a running job (MPI's processor names), else ``fallback_rank``.

    Raises RuntimeError when none of them is known (torch's contract)."""
    from overlap.comm import get_local_rank, is_initialized

    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    if is_initialized():
        return get_local_rank()
    if fallback_rank is not None:
        return int(fallback_rank)
    raise RuntimeError(
        "get_node_local_rank: LOCAL_RANK is not set and no job is running; start the job "
        "(overlap.init_distributed) or pass fallback_rank="
    )


def is_gloo_available() -> bool:
    """Whether this torch build has the gloo backend (torch's answer)."""
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_gloo_available())


def is_nccl_available() -> bool:
    """Whether this torch build has the NCCL backend (torch's answer; a GPU is another
    question: ``torch.cuda.is_available()``)."""
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_nccl_available())


def is_mpi_available() -> bool:
    """Whether overlap's MPI backend can run here: mpi4py is installed.

    Not torch's answer, which says whether torch itself was built with MPI (almost never
    for the wheels); overlap's MPI backend runs over mpi4py instead. Looked up without
    importing mpi4py, which would initialise MPI in this process."""
    return importlib.util.find_spec("mpi4py") is not None


def is_torchelastic_launched() -> bool:
    """Whether torchrun (torch.distributed.elastic) started this process (torch's answer)."""
    import torch.distributed as dist

    return bool(dist.is_torchelastic_launched())
