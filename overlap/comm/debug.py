"""Debug mode: catch mismatched collectives before they hang or corrupt data.

With ``OVERLAP_DEBUG=1`` in the environment (or ``init_distributed(debug=True)``), every
collective first all-gathers, on a dedicated debug group with the same members, a
fingerprint of what each rank is about to issue: its sequence number on that group, the op
name, and every tensor's dtype and shape. If any rank differs, every rank raises
:class:`~overlap.errors.CollectiveMismatchError` naming the ranks that differ and what each
issued, instead of hanging in (or silently mis-reducing) the real collective.

It costs one small blocking all_gather per collective: a mode for finding bugs, not for
training runs. Point-to-point ops are not checked (they are not collective).

Each group has its own debug group and sequence counter, keyed by the group itself, not by
its ranks: the BucketScheduler's two groups have the world's ranks, and their checks run on
its worker thread while the caller's run on the main one (0.1.0 shared one counter among
them and flagged correct programs). Debug groups are made where every rank is present:
by ``comm.new_group`` for its group, and for the world at its first check. A group made
otherwise (before debug mode was on, or by torch directly) is not checked.

The fingerprint holds the reduce op and the root (src/dst) as well as the shapes, so
``sum`` on one rank and ``max`` on another, or two broadcast roots, are caught too.
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Sequence
from typing import Any

import torch

from overlap.errors import CollectiveMismatchError

__all__ = ["check", "enabled", "forget", "make_group", "set_enabled"]

_DESC = 192  # bytes of description exchanged per rank


def env_enabled() -> bool:
    """Whether OVERLAP_DEBUG in the environment asks for debug mode."""
    return os.environ.get("OVERLAP_DEBUG", "0") not in ("", "0", "false", "False")


_enabled = env_enabled()
_groups: dict[Any, Any] = {}  # group (or "world") -> its debug group
_seq: dict[Any, int] = {}
_lock = threading.Lock()
_inside = threading.local()


def enabled() -> bool:
    return _enabled


def set_enabled(on: bool) -> None:
    global _enabled
    _enabled = on


def make_group(group: Any, new_group: Any) -> None:
    """Make ``group``'s debug group now (``new_group`` is called on every rank)."""
    from overlap.comm.groups import NonMemberGroup

    dbg = new_group()
    if not isinstance(group, NonMemberGroup) and type(group).__name__ != "NonMemberGroup":
        with _lock:
            _groups[group] = dbg


def forget(group: Any = None) -> list[Any]:
    """Drop ``group``'s debug group (every one with None: the job is being destroyed);
    returns them, for the caller to destroy."""
    with _lock:
        if group is None:
            out = list(_groups.values())
            _groups.clear()
            _seq.clear()
            return out
        _seq.pop(group, None)
        dbg = _groups.pop(group, None)
    return [] if dbg is None else [dbg]


def _describe(op: str, tensors: Sequence[Any]) -> str:
    parts = []
    for t in tensors:
        if isinstance(t, torch.Tensor):
            parts.append(f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}")
        elif isinstance(t, (list, tuple)):
            parts.append(
                "["
                + ",".join(
                    f"{str(x.dtype).replace('torch.', '')}{list(x.shape)}"
                    for x in t
                    if isinstance(x, torch.Tensor)
                )
                + "]"
            )
    return f"{op}({', '.join(parts)})"


def check(op: str, group: Any, tensors: Sequence[Any]) -> None:
    """Raise CollectiveMismatchError on every rank if the ranks of ``group`` disagree."""
    if getattr(_inside, "active", False):
        return  # the check's own all_gather
    from overlap import comm

    w = comm.get_world_size(group)
    if w == 1:
        return
    ranks = tuple(comm.get_global_rank(group, i) for i in range(w))
    key = "world" if group is None else group
    with _lock:
        dbg = _groups.get(key)
    if dbg is None:
        if group is not None:
            return  # made before debug mode was on, or not by comm.new_group: not checked
        _inside.active = True
        try:
            from overlap.comm import state

            dbg = state.active().new_group(list(ranks))  # the world: every rank is here
        finally:
            _inside.active = False
        with _lock:
            dbg = _groups.setdefault(key, dbg)
    with _lock:
        seq = _seq.get(key, 0)
        _seq[key] = seq + 1
    _inside.active = True
    try:
        desc = _describe(op, tensors)
        raw = desc.encode()[:_DESC]
        mine = torch.zeros(_DESC + 16, dtype=torch.uint8)
        head = torch.tensor([seq, zlib.crc32(desc.encode())], dtype=torch.int64)
        mine[:16] = head.view(torch.uint8)
        mine[16 : 16 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        everyone = comm.all_gather(mine, group=dbg)
    finally:
        _inside.active = False
    infos = []
    for t in everyone:
        s, crc = t[:16].clone().view(torch.int64).tolist()
        text = bytes(t[16:].numpy()).rstrip(b"\x00").decode(errors="replace")
        infos.append((s, crc, text))
    if len({(s, c) for s, c, _ in infos}) > 1:
        ref = infos[0]
        differ = [ranks[i] for i, x in enumerate(infos) if x[:2] != ref[:2]]
        detail = "; ".join(f"rank {ranks[i]}: #{s} {text}" for i, (s, _, text) in enumerate(infos))
        raise CollectiveMismatchError(
            f"collective mismatch on the group of ranks {list(ranks)}: ranks {differ} issued "
            f"something other than rank {ranks[0]} ({detail}). Every rank must issue the "
            "same collectives, with the same shapes and dtypes, in the same order",
            ranks=differ,
        )
