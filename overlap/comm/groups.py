"""Process groups of the torch backend: resolution, membership checks, printable names.

Groups are torch ``ProcessGroup`` objects, so they interoperate with ``torch.distributed``.
A rank that is not in a group created by ``new_group`` gets a :class:`NonMemberGroup`
instead of torch's bare sentinel, so using it fails with a message that lists the members.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from overlap.comm import state
from overlap.comm.backend_names import backend_name

__all__ = ["GroupInfo", "NonMemberGroup", "forget_group", "is_live", "resolve_group"]


@dataclass(frozen=True)
class NonMemberGroup:
    """Returned by ``new_group`` on ranks outside the group; every op on it raises."""

    ranks: tuple[int, ...]
    rank: int

    def __repr__(self) -> str:
        return f"<NonMemberGroup ranks={list(self.ranks)} (rank {self.rank} is not a member)>"


@dataclass(frozen=True)
class GroupInfo:
    pg: Any  # torch ProcessGroup
    ranks: tuple[int, ...]  # global ranks, in group-rank order
    name: str
    size: int
    rank: int  # this process's rank inside the group
    global_rank: int  # this process's global rank
    index: dict[int, int]  # global rank -> group rank


_cache: dict[Any, GroupInfo] = {}


def resolve_group(group: Any) -> GroupInfo:
    """Group info for ``group`` (None = world), raising ValueError for a non-member's group."""
    if isinstance(group, NonMemberGroup):
        raise ValueError(
            f"this rank ({group.rank}) is not a member of the group with ranks "
            f"{list(group.ranks)}; call ops on that group only from its member ranks"
        )
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            "this rank is not a member of the group it passed; call ops on a group only "
            "from its member ranks"
        )
    pg = dist.group.WORLD if group is None else group
    info = _cache.get(pg)
    if info is None:
        if not isinstance(pg, dist.ProcessGroup):
            raise TypeError(
                f"group must be a process group from overlap.comm.new_group (or None for the "
                f"world), got {type(group).__name__}"
            )
        ranks = _live_ranks(pg)
        if ranks is None:
            raise ValueError(
                "this process group belongs to a job that destroy_process_group() has ended "
                "(torch freed it then): make the group again with overlap.comm.new_group() "
                "after init_distributed()"
            )
        name = "world" if pg is dist.group.WORLD else "ranks" + ",".join(map(str, ranks))
        _check_backend(pg, name)
        index = {g: i for i, g in enumerate(ranks)}
        info = GroupInfo(pg, ranks, name, len(ranks), dist.get_rank(pg), dist.get_rank(), index)
        _cache[pg] = info
    return info


def _check_backend(pg: Any, name: str) -> None:
    """Refuse a group made with torch's own ``dist.new_group(backend=...)`` on another
    backend than the job's (a gloo group in an NCCL job): overlap runs every op the job's
    way, so its first op failed with a misleading device error, or worse. Once per group
    (its info is cached); ``overlap.comm.new_group`` refuses such a group before making it."""
    if not state.is_active():
        return
    try:
        spec = str(dist.get_backend(pg))
    except (RuntimeError, ValueError):  # a torch that cannot say: nothing to compare
        return
    job = state.active().name
    if backend_name(spec) != job:
        raise ValueError(
            f"group {name} runs on torch's {spec!r} backend but this job's backend is "
            f"{job!r}; overlap runs every group of a job on the job's backend. Make the "
            "group with overlap.comm.new_group(ranks), without backend="
        )


def _live_ranks(pg: Any) -> tuple[int, ...] | None:
    """``pg``'s global ranks, or None when torch no longer knows it (a group made before
    the last ``destroy_process_group()`` is gone, and torch's own calls raise a bare
    KeyError)."""
    try:
        return tuple(dist.get_process_group_ranks(pg))
    except (KeyError, ValueError, RuntimeError):
        return None


def is_live(pg: Any) -> bool:
    """Whether torch still knows ``pg`` (:func:`_live_ranks`)."""
    return _live_ranks(pg) is not None


def clear_cache() -> None:
    _cache.clear()


def forget_group(pg: Any) -> None:
    """Drop one group's cached info (it is being destroyed)."""
    _cache.pop(pg, None)
