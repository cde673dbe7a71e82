"""Debug mode: catch mismatched collectives before they hang or corrupt data.

With ``OVERLAP_DEBUG=1`` in the environment (or ``init_distributed(debug=True)``), every
collective first all-gathers, on a dedicated debug group with the same members, a
fingerprint of what each rank is about to issue: its sequence number on that group, the op
name, and every tensor's dtype and shape. If any rank differs, every rank raises
:class:`~overlap.errors.CollectiveMismatchError` naming the ranks that differ and what each
issued, instead of hanging in (or silently mis-reducing) the real collective.

It costs one small blocking all_gather per collective: a mode for finding bugs, not for
training runs. Point-to-point messages (gloo, and MPI on the CPU) get a header instead,
checked where the message lands (overlap.comm.p2p_debug).

Each group has its own debug group and sequence counter, keyed by the group itself, not by
its ranks: the BucketScheduler's two groups have the world's ranks, and their checks run on
its worker thread while the caller's run on the main one (0.1.0 shared one counter among
them and flagged correct programs). Debug groups are made where every rank is present:
by ``comm.new_group`` for its group, and for the world at its first check. A group made
otherwise (before debug mode was on, or by torch directly) is not checked.

The fingerprint holds the reduce op and the root (src/dst) as well as the shapes, so
``sum`` on one rank and ``max`` on another, or two broadcast roots, are caught too.

All-to-all ops are the exception to "every rank issues the same shapes": with uneven
splits each rank sends and receives its own amounts. Their fingerprint holds the dtypes
and the shapes past the first dimension (all_to_all_single), or only the lists' lengths
(all_to_all of lists), and a second all_gather exchanges each rank's send and receive
counts with their dtypes (elements per peer, :func:`count`): rank i's count for j must be
what j expects from i, in the same dtype. 0.1.0 compared whole shapes, and so flagged
every correct uneven all-to-all; until the fortieth session a list all-to-all's dtypes
were compared by position, so one that sent float64 to rank 0 and float32 to the others
(each rank's outputs then differ) was flagged too.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Sequence
from typing import Any

import torch

from overlap.comm.knobs import switch
from overlap.comm.p2p import describe, dtype_name
from overlap.dtypes import present
from overlap.errors import CollectiveMismatchError

__all__ = ["check", "count", "enabled", "forget", "make_group", "set_enabled"]

_DESC = 192  # bytes of description exchanged per rank


def env_enabled() -> bool:
    """Whether OVERLAP_DEBUG in the environment asks for debug mode."""
    return switch("OVERLAP_DEBUG", False)


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


def _one(t: torch.Tensor, uneven: bool) -> str:
    if not uneven:
        return describe(t)
    dtype = dtype_name(t.dtype)  # an all-to-all: the first dimension may differ by rank
    return f"{dtype}[{', '.join(['*', *map(str, t.shape[1:])])}]" if t.dim() else dtype


_NAMES = [
    "float32", "float64", "float16", "bfloat16", "complex64", "complex128", "complex32",
    "int8", "uint8", "int16", "int32", "int64", "bool", "uint16", "uint32", "uint64",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
]  # fmt: skip
_CODES = {d: i for i, n in enumerate(_NAMES) for d in present(n)}
_OTHER = 63  # any other dtype (codes are 6 bits)


def count(numel: int, dtype: torch.dtype) -> int:
    """An all-to-all's elements for one peer and their dtype, as one int64 for the
    pairwise check (-1 stays -1: bad arguments)."""
    return -1 if numel < 0 else numel * 64 + _CODES.get(dtype, _OTHER)


def _spell(v: int) -> str:
    """``3 float32``: an encoded :func:`count` as messages say it."""
    code = v % 64
    return f"{v // 64} {_NAMES[code] if code < len(_NAMES) else 'other-dtype'}"


def _describe(op: str, tensors: Sequence[Any], uneven: bool = False) -> str:
    """``op(dtype[shape], ...)``; ``uneven`` (an all-to-all): a tensor's first dimension
    as ``*`` and a list by its length alone, since its tensors' sizes and dtypes may differ
    by rank (the counts check pairs them up)."""
    parts = []
    for t in tensors:
        if isinstance(t, torch.Tensor):
            parts.append(_one(t, uneven))
        elif isinstance(t, (list, tuple)):
            xs = [x for x in t if isinstance(x, torch.Tensor)]
            if uneven:
                parts.append(f"[{len(xs)} tensors]")
            else:
                parts.append("[" + ",".join(_one(x, False) for x in xs) + "]")
    return f"{op}({', '.join(parts)})"


def check(
    op: str,
    group: Any,
    tensors: Sequence[Any],
    counts: tuple[Sequence[int], Sequence[int]] | None = None,
) -> None:
    """Raise CollectiveMismatchError on every rank if the ranks of ``group`` disagree.

    ``counts``: an all-to-all's (elements sent to, elements expected from) each rank of the
    group, in group order (-1 where this rank's own arguments are bad: its backend call
    raises); then sizes are checked pairwise, not for equality (module docstring)."""
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
        desc = _describe(op, tensors, uneven=counts is not None)
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
    if counts is not None:
        _check_counts(op, ranks, dbg, counts)


def _check_counts(
    op: str, ranks: tuple[int, ...], dbg: Any, counts: tuple[Sequence[int], Sequence[int]]
) -> None:
    """Every rank i's count for rank j equals what j expects from i (see :func:`check`)."""
    from overlap import comm

    mine = torch.tensor([*counts[0], *counts[1]], dtype=torch.int64)
    _inside.active = True
    try:
        everyone = [t.tolist() for t in comm.all_gather(mine, group=dbg)]
    finally:
        _inside.active = False
    w = len(ranks)
    bad = [
        (i, j, everyone[i][j], everyone[j][w + i])
        for i in range(w)
        for j in range(w)
        if everyone[i][j] >= 0 and everyone[j][w + i] >= 0 and everyone[i][j] != everyone[j][w + i]
    ]
    if bad:
        detail = "; ".join(
            f"rank {ranks[i]} sends {_spell(s)} elements to rank {ranks[j]}, which expects "
            f"{_spell(e)}"
            for i, j, s, e in bad[:8]
        )
        raise CollectiveMismatchError(
            f"collective mismatch on the group of ranks {list(ranks)}: {op} sizes do not "
            f"pair up ({detail}{'; ...' if len(bad) > 8 else ''}). Rank i's input split for "
            "rank j must equal rank j's output split for rank i, in the same dtype",
            ranks=sorted({ranks[k] for i, j, _, _ in bad for k in (i, j)}),
        )
