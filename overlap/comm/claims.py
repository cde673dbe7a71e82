"""The memory of collectives in flight: an op issued on memory that a collective in flight
writes (or reads, when the new op writes it) first waits for that collective, as NCCL's
stream order would.

Every ``async_op=True`` collective claims its tensors until its handle completes: the ones
it writes (an all_reduce's tensor, a gather's outputs) and the ones it only reads (an
all_gather's input, a broadcast's tensor on its root). Before any op is issued, collective
or point to point, its own tensors are checked against the claims in flight, byte range by
byte range; where either side writes bytes the other touches, the new op waits for the
collective to complete (its ``wait()``, which the backend's job timeout bounds) and then goes
ahead. Two reads of the same bytes stay concurrent. Ops on different groups are ordered
too (NCCL orders one group's ops, on its stream, and lets two groups' race): memory shared by
two ops in flight is a race whatever their groups.

Why: on NCCL, ops of one process issue onto one stream and run in issue order, so
``h1 = all_reduce(t, async_op=True); h2 = all_reduce(t, async_op=True)`` gives the sum
of sums. gloo runs ops on a pool of threads, and MPI runs nonblocking collectives side by
side on whatever buffers they name, so the same two lines raced (measured on 2 ranks,
torch 2.13 and MPICH 5): gloo gave 3.0 where the order gives 4.0; MPI gave a broadcast
then an all_reduce of one tensor two different results on the two ranks (4.0 and 2.0), and
two all_reduces of a 256 KiB tensor a mix of 3.0 and 4.0 within the tensor. Silently, in
every case: code written for NCCL, tested on CPU with gloo, and a wrong tensor.

Sends and receives are checked but claim nothing: a later op on the buffer of a send or
receive in flight is not ordered after it (wait for it first, as MPI's rules ask). Claiming
them too cost an 8-byte MPI sendrecv pair 8.4 -> 14 us on 2 ranks (two claims and a check
each pair, about 1.8 us of Python single-process, slowed by the two ranks sharing two cores),
4.0 -> 5.3x mpi4py's in ``overlap bench ops``, for a pattern (reusing a buffer still in flight
in a send or receive) that MPI and gloo already forbid, and that NCCL does not order either:
torch's NCCL group runs point-to-point ops on a stream per pair of ranks, apart from the
stream of its collectives (pytorch/pytorch#132852), so code written for NCCL waits for a
receive before it reads the buffer there too.

Cost: a collective's claim is a weak reference to its handle in one dict, and its tensors
in the handle (``_claim``), dropped when it completes. The check runs only while some claim
is in flight, and not on overlap's own threads (the bucket worker, the steps drivers), which
order their ops themselves: a wait there could stall the thread that completes the very op
waited for. Nor does an op issued from a handle's done-callback wait (a callback runs on a
backend's thread, which must never block): it goes ahead unordered, with a warning.
With up to eight claims in flight a check looks at each; with more it indexes
them by the storage their tensors' bytes live in (its data pointer; two allocations never
overlap), once per claim, and looks only at the claims on its own tensors' storages, so its
cost does not grow with the number of ops in flight (10,000 awaited at once in the
reliability tests: 4.6 s with the index, 53 s with a scan of all of them per op). CUDA
tensors are not claimed: on NCCL the stream orders them already. A first wait logs a warning
naming both ops, so a double reduction by mistake shows up.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from overlap.comm.handle import CLAIMS, IN_CALLBACK, PENDING
from overlap.errors import CommTimeoutError, OverlapError

if TYPE_CHECKING:
    from overlap.comm.handle import Handle

__all__ = [
    "claim",
    "claim1",
    "internal_thread",
    "live",
    "on_internal_thread",
    "settle",
    "settle1",
]

log = logging.getLogger(__name__)

# (start, end, writes?) of one tensor's bytes
Range = tuple[int, int, bool]

# id(handle) -> a weak reference to it, for the ops in flight that claim tensors; the claim
# itself is the handle's ``_claim``: (op name, ranges, the tensors, one per range).
# Handle._finish drops the entry.
live = CLAIMS
_fresh: list[int] = []  # the claims made since the index was last brought up to date
# storage data pointer -> {id(handle): the claim's ranges on that storage}: may hold
# claims that have completed since (dropped when met, or when the index is rebuilt)
_index: dict[int, dict[int, tuple[Range, ...]]] = {}
_indexed = 0  # ranges put in the index since it was last rebuilt
# whether the index is kept up to date (claims go to _fresh): only while more than _SCAN
# claims are in flight; the first check past that builds it from the claims in flight
_indexing = False
_ref = weakref.ref
_SCAN = 8  # up to this many claims in flight, a check looks at each, with no index
_lock = threading.Lock()  # one check changes the index at a time


class _Thread(threading.local):
    internal = False  # a class default: reading it never raises (getattr's default did)


_thread = _Thread()
_warned: set[tuple[str, str]] = set()


def on_internal_thread() -> bool:
    """Whether the calling thread is one of overlap's own (:func:`internal_thread`)."""
    return _thread.internal


def internal_thread() -> None:
    """Mark the calling thread as one of overlap's own (a bucket worker, a steps driver):
    its ops are claimed but never wait on others' claims (module docstring)."""
    _thread.internal = True


def _ranges(
    writes: Iterable[Any], reads: Iterable[Any]
) -> tuple[tuple[Range, ...], tuple[Any, ...]]:
    """The byte ranges of the CPU tensors among ``writes`` and ``reads``, and those tensors
    (anything else, bad input included, is left to the backend's checks)."""
    out: list[Range] = []
    ts_out = []
    for ts, w in ((writes, True), (reads, False)):
        for t in ts:
            r = _one(t, w)
            if r:
                out += r
                ts_out.append(t)
    return tuple(out), tuple(ts_out)


def _one(t: Any, w: bool) -> tuple[Range, ...]:
    """The byte range of ``t`` if it is a CPU tensor with bytes (``w``: whether the op
    writes it), else nothing; alone on the hot paths (all_reduce, broadcast, p2p)."""
    try:
        if t.is_cpu:
            n = t.nbytes
            if n:
                p = t.data_ptr()
                return ((p, p + n, w),)
    except Exception:  # not a tensor (a list, None), or one with no data pointer
        pass
    return ()


def claim(handle: Handle, op: str, writes: Any, reads: Any = ()) -> None:
    """Claim ``writes`` and ``reads`` (sequences of tensors) for ``handle``'s op until it
    completes (:meth:`Handle._finish` drops the claim)."""
    if handle._state is PENDING:
        rs, ts = _ranges(writes, reads)
        if rs:
            _enter(handle, (op, rs, ts))


def claim1(handle: Handle, op: str, t: Any, writes: bool) -> None:
    """:func:`claim` of one tensor (``writes``: whether the op writes it), on the hot paths
    (all_reduce, broadcast): its range is worked out at the first check that meets it, not
    here (an awaited 8-byte MPI all_reduce is 5 us)."""
    if handle._state is PENDING:
        _enter(handle, (op, t, writes))


def _claim_of(h: Handle) -> tuple[str, tuple[Range, ...], tuple[Any, ...]]:
    """``h``'s claim as (op, ranges, tensors), working out a one-tensor claim's range the
    first time."""
    c = h._claim
    if type(c[1]) is tuple:
        return c  # type: ignore[no-any-return]
    op, t, w = c
    c = h._claim = (op, _one(t, w), (t,))
    return c


def _enter(handle: Handle, c: tuple[Any, Any, Any]) -> None:
    handle._claim = c
    key = id(handle)
    # a weak reference: a handle the user drops in flight must still reach Handle.__del__,
    # which hands it to its engine to be observed to the end (held here, an MPI op that
    # nobody awaited stayed open for good)
    live[key] = _ref(handle)
    if _indexing:
        _fresh.append(key)
    if handle._state is not PENDING:  # it completed meanwhile, on a backend thread
        live.pop(key, None)


def _index_fresh() -> None:
    """Bring the index up to date with the claims made since (call with _lock held)."""
    global _indexed, _indexing
    if not _indexing or _indexed > 4 * len(live) + 256:  # start again from those in flight
        _index.clear()
        _indexed = 0
        _indexing = True
        _fresh[:] = list(live)
    while _fresh:
        key = _fresh.pop()
        h = _pending(key)
        if h is None:
            continue
        _, rs, ts = _claim_of(h)
        by: dict[int, list[Range]] = {}
        for r, t in zip(rs, ts, strict=True):
            by.setdefault(t.untyped_storage().data_ptr(), []).append(r)
        for base, mine in by.items():
            _index.setdefault(base, {})[key] = tuple(mine)
            _indexed += 1


def _pending(key: int) -> Handle | None:
    """The handle of claim ``key`` while its op is in flight, else None (a claim that
    outlived its handle, which only a torn-down engine leaves, is dropped)."""
    ref = live.get(key)
    if ref is None:
        return None
    h: Handle | None = ref()
    if h is None:
        if live.get(key) is ref:
            live.pop(key, None)
        return None
    return h if h._state is PENDING else None


def settle(op: str, writes: Any, reads: Any = ()) -> None:
    """Before issuing ``op`` on ``writes`` and ``reads``: wait for every op in flight whose
    claim conflicts with them. Call only when :data:`live` is not empty."""
    if not _thread.internal:
        mine, ts = _ranges(writes, reads)
        if mine:
            _settle(op, mine, ts)


def settle1(op: str, t: Any, writes: bool) -> None:
    """:func:`settle` for one tensor (``writes``: whether the new op writes it)."""
    if not _thread.internal:
        mine = _one(t, writes)
        if mine:
            _settle(op, mine, (t,))


def _settle(op: str, mine: tuple[Range, ...], ts: tuple[Any, ...]) -> None:
    global _indexing
    waits: list[tuple[Handle, str, bool]] = []
    if len(live) <= _SCAN:  # a few ops in flight: look at each (no index kept up)
        if _indexing:
            with _lock:  # the next indexed check starts again from the claims in flight
                _indexing = False
                _index.clear()
                _fresh.clear()
        for key, ref in list(live.items()):
            h = ref()
            if h is None:  # dropped without completing (only a torn-down engine does)
                if live.get(key) is ref:
                    live.pop(key, None)
            elif h._state is PENDING:
                c = _claim_of(h)
                _conflicts(mine, c[1], h, c[0], waits)
    else:
        if _fresh or not _indexing:
            with _lock:
                _index_fresh()
        for r, t in zip(mine, ts, strict=True):
            claims = _index.get(t.untyped_storage().data_ptr())
            if not claims:
                continue
            for key, theirs in list(claims.items()):
                h = _pending(key)
                if h is None:
                    claims.pop(key, None)  # completed: no longer a claim
                    continue
                _conflicts((r,), theirs, h, h._claim[0], waits)
    if waits and IN_CALLBACK.on:
        # a done-callback runs on a backend's thread, which must never block (DESIGN.md
        # 3.2): the op goes ahead unordered, and says so
        log.warning(
            "%s was issued from a handle's done-callback on memory that %s, still in "
            "flight, uses: a callback cannot wait, so the two are not ordered; issue it "
            "after awaiting the first op instead",
            op,
            waits[0][1],
        )
        return
    for h, their_op, they_write in waits:
        _wait(op, h, their_op, they_write)


def _conflicts(
    mine: tuple[Range, ...],
    theirs: tuple[Range, ...],
    h: Handle,
    their_op: str,
    waits: list[tuple[Handle, str, bool]],
) -> None:
    """Add (h, their_op, whether they write) to ``waits`` when a range of ``mine`` and one
    of ``theirs`` share bytes and either writes them."""
    for lo, hi, w in mine:
        for lo2, hi2, w2 in theirs:
            if (w or w2) and lo < hi2 and lo2 < hi:
                waits.append((h, their_op, w2))
                return


def _wait(op: str, h: Handle, their_op: str, they_write: bool) -> None:
    pair = (op, their_op)
    level = logging.DEBUG if pair in _warned else logging.WARNING
    _warned.add(pair)
    log.log(
        level,
        "%s was issued on memory that %s, still in flight, %s: it waits for that op "
        "first, as NCCL's stream order would. To keep them concurrent, give them separate "
        "tensors; to make the order plain, wait for the first op before issuing the second",
        op,
        their_op,
        "writes" if they_write else "reads",
    )
    try:
        h.wait()
    except CommTimeoutError as exc:
        raise CommTimeoutError(
            f"{op} waits for {their_op} in flight on the same memory, which did not complete: {exc}"
        ) from exc
    except OverlapError:
        pass  # that op failed: its own awaiter hears of it; the memory is free now
