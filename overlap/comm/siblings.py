"""New groups over the ranks of a group the caller was given, made as ``new_group`` demands.

A BucketScheduler runs its collectives on groups of its own with the ranks of the group it
was given. ``new_group`` is a collective over the whole job with the same ranks on every
rank (torch's rule; MPI's too, but for disjoint groups), so a rank cannot make a group of its
own data-parallel group's ranks alone while the ranks of another data-parallel group make
theirs: each rank passed other ranks to the same call, and on gloo every rank hung (a
BucketScheduler per data-parallel group of a 2 x 2 topology, found by trying it).

So every rank of the job says which ranks its group has (one object all-gather), and every
rank makes the group of each distinct list, in one order, keeping its own: the usual SPMD
program, where every rank builds its scheduler over its own group at the same time. Lists
that disagree (a rank named in a group whose members say otherwise), and a rank that passed
a group it is not a member of, are refused on every rank, with nothing made. That rank takes
part in the all-gather first: before, it raised alone (its group's size is unknown to a
non-member) and the members waited in the all-gather until the backend's timeout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["groups_like"]


def groups_like(ranks: Sequence[int], count: int, what: str) -> list[Any]:
    """``count`` new groups of ``ranks`` (the global ranks of the group this rank was given,
    which it should be a member of); every rank of the job calls it at once, each with its
    own group's ranks. ``what`` names the caller in a refusal."""
    from overlap.comm import all_gather_object, get_world_size, new_group
    from overlap.comm.torch_names import new_subgroups_by_enumeration

    mine = tuple(sorted(int(r) for r in ranks))
    world = get_world_size()
    said: list[Any] = [None] * world
    all_gather_object(said, mine)
    outside = [r for r in range(world) if r not in said[r]]
    if outside:
        r = outside[0]
        raise ValueError(
            f"{what}: rank {r} was given the group of ranks {list(said[r])}, which it is not a "
            f"member of: every rank of the job builds its {what} at the same time, each over a "
            "group it belongs to (for example its own data-parallel group of a topology)"
        )
    lists = sorted(set(said))
    for group in lists:
        wrong = [m for m in group if said[m] != group]
        if wrong:
            raise ValueError(
                f"{what}: the ranks disagree on their groups: ranks {list(group)} are one group "
                f"for some of them, but rank {wrong[0]} gave ranks {list(said[wrong[0]])}; every "
                "rank builds it at the same time over its own group, and the members of a "
                "group name the same ranks (for example one data-parallel group of a "
                "topology each)"
            )
    if lists == [tuple(range(world))]:
        return [new_group(list(mine)) for _ in range(count)]
    out = []
    for _ in range(count):
        own, _all = new_subgroups_by_enumeration([list(g) for g in lists])
        out.append(own)
    return out
