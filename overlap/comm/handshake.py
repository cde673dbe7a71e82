"""Do the processes that met at the rendezvous make one job? Checked on torch's store before
the process group is made, so that a job started wrongly fails at once, on every rank, with
what differs and where.

Why (fifty-eighth session, processes started by hand as a SLURM script or a shell loop
would): ranks started with different ``WORLD_SIZE`` (2 on rank 0, 3 on rank 1) got through
torch's rendezvous, and rank 0's first collective timed out after the whole job timeout
(gloo's "Timed out waiting 8000ms for recv operation"), followed by "terminate called
without an active exception" at its exit, while rank 1 reported a store key it waited for.
Two processes given the same ``RANK`` (and none the last) waited out the timeout on every
rank for a key named ``/default_pg/0//cpu//0/2``. Debug mode on one rank only
(``OVERLAP_DEBUG=1`` in one environment) made that rank issue collectives the others did
not: both timed out in the first ``all_reduce``. None of those errors named the cause.

How: every rank writes a record of itself (rank, world size, backend, debug mode, host,
pid, overlap's and torch's versions) under ``overlap/init/<round>/`` of the store the
rendezvous gave, compares it with rank 0's, and says in the store whether it agrees; then it
waits until rank 0's world size of ranks has said so, and raises on every rank if one did
not. A second process for one rank is told by a counter per rank. Four small keys a rank
and two waits: nothing next to the process group's own set-up. A rank that waits logs the
count of ranks that have joined (:class:`Progress`), and one that times out names the ranks
that never came.
"""

from __future__ import annotations

import datetime
import itertools
import json
import logging
import os
import socket
import time
from typing import Any

from overlap.errors import CommTimeoutError

__all__ = ["Progress", "check_records", "handshake", "record"]

log = logging.getLogger(__name__)

_PREFIX = "overlap/init"
_SLICE_S = 1.0  # a wait on the store is one request a second: it can say how far it got
_NAMED = 8  # at most this many ranks are named in an error; the rest are counted
# this process's handshakes: every rank of a job makes its groups alike, so the n-th of each
# meets the others' n-th (a store may outlive a group: torchrun's agent keeps one per attempt)
_rounds = itertools.count(1)
# the fields that must be the same on every rank, and the words that say what each is
_MUST_AGREE = {
    "world_size": "WORLD_SIZE",
    "backend": "backend",
    "debug": "debug mode (OVERLAP_DEBUG or init_distributed(debug=))",
}
_SHOULD_AGREE = {"overlap": "overlap version", "torch": "torch version"}


class Progress:
    """What an init waits for, in words, for the log of a wait that takes long
    (:func:`overlap.comm.rendezvous.logged_wait` reads ``text``)."""

    def __init__(self, text: str) -> None:
        self.text = text


def record(rank: int, world_size: int, backend: str, debug: bool) -> dict[str, Any]:
    """What this process says of itself at the handshake."""
    import torch

    from overlap import __version__

    return {
        "rank": rank,
        "world_size": world_size,
        "backend": backend,
        "debug": debug,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "overlap": __version__,
        "torch": torch.__version__,
    }


def _said(rec: dict[str, Any], problems: list[str]) -> str:
    """One rank's refusal: who it is (rank, pid, host) and what is wrong with it."""
    return f"rank {rec['rank']} (pid {rec['pid']} on {rec['host']}): {'; '.join(problems)}"


def _differences(mine: dict[str, Any], first: dict[str, Any]) -> list[str]:
    """What in ``mine`` must agree with rank 0's record ``first`` and does not."""
    out = [
        f"{words} {mine[k]!r} where rank 0 has {first[k]!r}"
        for k, words in _MUST_AGREE.items()
        if mine.get(k) != first.get(k)
    ]
    if not 0 <= mine["rank"] < int(first["world_size"]):
        out.append(f"rank {mine['rank']} is outside rank 0's WORLD_SIZE {first['world_size']}")
    return out


class _Deadline:
    def __init__(self, timeout_s: float) -> None:
        self.end = time.monotonic() + timeout_s
        self.timeout_s = timeout_s

    def left(self) -> float:
        return self.end - time.monotonic()


def _wait(store: Any, key: str, deadline: _Deadline, progress: Progress, say: Any) -> bool:
    """Wait for ``key`` in the store until the deadline, in slices, refreshing
    ``progress.text`` with ``say()`` between them; False when the deadline passed."""
    while True:
        if store.check([key]):
            return True
        left = deadline.left()
        if left <= 0:
            return False
        slice_s = min(_SLICE_S, left)
        start = time.monotonic()
        try:
            store.wait([key], datetime.timedelta(seconds=slice_s))
            return True
        except Exception:  # the slice ran out (DistStoreError; RuntimeError on torch 2.2)
            if time.monotonic() - start < slice_s / 2:
                raise  # not a slice that ran out: the store failed (its rank 0 is gone)
            progress.text = say()


def handshake(
    store: Any,
    mine: dict[str, Any],
    timeout_s: float,
    progress: Progress | None = None,
    round_: int | None = None,
) -> None:
    """Check on ``store`` that the processes at this rendezvous make one job, on every rank
    of it; return when they do. ``mine``: this rank's :func:`record`.

    Raises ValueError on every rank (each that gets this far) naming the ranks and what
    differs when: two processes have one rank, a rank's world size, backend or debug mode
    is not rank 0's, or a rank lies outside rank 0's world. A process that is one too many
    (a second process for a rank, a rank outside the world) is always refused; the others
    refuse with it unless rank 0's world had already agreed without it, whole, in which
    case that job goes on. Raises CommTimeoutError naming
    the ranks that never came when they are not all here within ``timeout_s``. Other
    versions of overlap or torch than rank 0's are logged as a warning."""
    progress = progress or Progress("")
    rank, world = int(mine["rank"]), int(mine["world_size"])
    base = f"{_PREFIX}/{next(_rounds) if round_ is None else round_}"
    deadline = _Deadline(timeout_s)

    def joined() -> int:
        return int(store.add(f"{base}/joined", 0))

    def say() -> str:
        return (
            f"at the handshake: {joined()} of {world} ranks have joined (ranks that have "
            f"not come yet, or rank 0 still waits for every rank to connect)"
        )

    problems: list[str] = []
    if int(store.add(f"{base}/n/{rank}", 1)) > 1:
        key = f"{base}/rec/{rank}"
        try:  # the first process wrote its record just after its count: wait a moment for it
            store.wait([key], datetime.timedelta(seconds=max(0.001, min(2.0, deadline.left()))))
            earlier: dict[str, Any] | None = _json(store.get(key))
        except Exception:  # not there yet: the refusal names no first process
            earlier = None
        other = f" (the first: pid {earlier['pid']} on {earlier['host']})" if earlier else ""
        problems.append(f"a second process was started as rank {rank}{other}")
    else:
        store.set(f"{base}/rec/{rank}", json.dumps(mine))
        store.add(f"{base}/joined", 1)
    progress.text = say()
    if not _wait(store, f"{base}/rec/0", deadline, progress, say):
        raise _timed_out(store, base, mine, deadline, "rank 0 never came")
    first = _json(store.get(f"{base}/rec/0"))
    if rank != 0 or problems:
        problems += _differences(mine, first)
    if problems:
        i = int(store.add(f"{base}/bad", 1)) - 1
        store.set(f"{base}/bad/{i}", _said(mine, problems))
    if int(store.add(f"{base}/checked", 1)) >= int(first["world_size"]):
        store.set(f"{base}/all", "1")
    if problems:  # this rank knows already; the others learn it from the store
        raise ValueError(_refusal([_said(mine, problems)], 1, first))
    if not _wait(store, f"{base}/all", deadline, progress, say):
        raise _timed_out(store, base, mine, deadline, "")
    bad = int(store.add(f"{base}/bad", 0))
    if bad:
        said = [store.get(f"{base}/bad/{i}").decode() for i in range(min(bad, _NAMED))]
        raise ValueError(_refusal(said, bad, first))
    _warn_versions(mine, first)


def check_records(records: list[dict[str, Any]], rank: int) -> None:
    """The handshake's check where every rank has every :func:`record` already (MPI: one
    allgather), as rank ``rank``: ValueError, alike on every rank, when they do not make one
    job; a warning for another version than rank 0's."""
    first = records[0]
    said = [_said(rec, found) for rec in records[1:] if (found := _differences(rec, first))]
    if said:
        raise ValueError(_refusal(said[:_NAMED], len(said), first))
    _warn_versions(records[rank], first)


def _warn_versions(mine: dict[str, Any], first: dict[str, Any]) -> None:
    versions = [f"{w} {first[k]} on rank 0, {mine[k]} here" for k, w in _SHOULD_AGREE.items()
                if mine.get(k) != first.get(k)]  # fmt: skip
    if versions:
        log.warning(
            "init_distributed: rank %d runs another %s; install the same versions on every host",
            mine["rank"],
            "; ".join(versions),
        )


def _json(raw: Any) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    return out


def _refusal(said: list[str], count: int, first: dict[str, Any]) -> str:
    more = f" and {count - len(said)} more" if count > len(said) else ""
    return (
        f"init_distributed: the processes at this rendezvous do not make one job of "
        f"{first['world_size']} ranks: {' | '.join(said)}{more}. Start every rank with the "
        "same WORLD_SIZE, backend and debug mode, and each rank number once (0 to "
        "WORLD_SIZE - 1); a launcher (torchrun, srun, mpiexec) sets them for you"
    )


def _timed_out(
    store: Any, base: str, mine: dict[str, Any], deadline: _Deadline, why: str
) -> CommTimeoutError:
    """The error of a handshake that waited ``timeout_s``: the ranks that never came, as
    far as this rank can tell (only the first few ranks look them up, one request per
    rank: a job of thousands would ask rank 0's store a million times)."""
    world = int(mine["world_size"])
    if int(mine["rank"]) < _NAMED:
        missing = [r for r in range(world) if not store.check([f"{base}/rec/{r}"])]
        shown = ", ".join(str(r) for r in missing[:_NAMED])
        more = f" and {len(missing) - _NAMED} more" if len(missing) > _NAMED else ""
        gone = f"rank(s) {shown}{more} of {world} never came" if missing else why
    else:
        gone = f"{int(store.add(f'{base}/joined', 0))} of {world} ranks came"
    return CommTimeoutError(
        f"init_distributed: rank {mine['rank']} waited {deadline.timeout_s:g} s at the "
        f"handshake and {gone or 'the ranks did not all agree in time'}. Start every rank "
        "(each rank number once, 0 to WORLD_SIZE - 1) with the same MASTER_ADDR and "
        "MASTER_PORT, or give init_distributed a longer timeout="
    )
