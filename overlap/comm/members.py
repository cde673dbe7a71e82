"""``new_group``'s members: checked on each rank, then agreed by every rank, before any group
is made.

``new_group`` is a collective over the whole job, and every rank must pass the same ranks
(torch's rule, and MPI's for ``MPI_Comm_create``). A rank that passed other ranks, or bad
ones, used to leave the others waiting: on 3 gloo ranks, rank 0 asking for ``[0, 1]`` while
ranks 1 and 2 asked for ``[1, 2]`` hung rank 0 until the backend's timeout (found by trying
it, forty-fifth session), and a rank whose list was refused here (a rank outside the world)
raised alone while the others went into the backend's group set-up.

So each rank first checks its own list (:func:`members_error`), then one all-gather over the
world carries each rank's verdict, its list's length and a crc32 of it; if any rank refused
its list, or the lists differ, every rank raises a ValueError and no group is made. One
small all-gather per ``new_group``, which already costs a store round trip and, on gloo, a
connection per pair of members.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["agree_on_members", "members_error"]


def members_error(ranks: Sequence[int], world: int) -> str | None:
    """What is wrong with ``ranks`` (sorted or not) as a group of a ``world``-rank job, or
    None. Both backends' rule: at least one rank, each a rank of the job, none twice."""
    if not ranks:
        return (
            "new_group: ranks is empty; pass the global ranks of the group's members "
            "(or None for every rank)"
        )
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        return f"new_group: ranks {bad} are outside the world of {world} ranks"
    if len(set(ranks)) != len(ranks):
        return f"new_group: ranks {list(ranks)} contain duplicates"
    return None


def agree_on_members(ranks: Sequence[int], world: int, device: Any) -> None:
    """Every rank of the job calls it with the ranks it passed to ``new_group`` (all of
    them for None). Raises on every rank, before any group is made, when a rank's list is
    refused by :func:`members_error` (that rank with its own message) or the ranks passed
    different lists."""
    from overlap.comm import all_gather

    own = members_error(ranks, world)
    key = sorted(int(r) for r in ranks)
    crc = zlib.crc32(",".join(map(str, key)).encode())
    mine = torch.tensor([int(own is not None), len(key), crc], dtype=torch.int64, device=device)
    said = [t.tolist() for t in all_gather(mine)]
    if own is not None:
        raise ValueError(own + "; no group was made on any rank")
    refused = [r for r, s in enumerate(said) if s[0]]
    if refused:
        raise ValueError(
            f"new_group: rank {refused[0]} refused the ranks it passed (its error says why); "
            "no group was made on any rank"
        )
    apart = [r for r, s in enumerate(said) if s[1:] != said[0][1:]]
    if apart:
        raise ValueError(
            f"new_group: ranks {apart} passed other ranks than rank 0 (this rank passed "
            f"{key}); every rank calls new_group with the same ranks, members or not, or, "
            "with use_local_synchronization=True, only the members call it; no group was made "
            "on any rank"
        )
