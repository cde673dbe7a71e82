"""Ring and naive allreduce written from awaitable send/recv.

``comm.all_reduce(t, op, algorithm="ring" | "naive")`` runs one of these instead of the
backend's native allreduce, blocking or awaited (they are steps generators, see
:mod:`overlap.comm.steps`):

* ring: reduce-scatter then all-gather around the ring, W-1 steps each; every rank sends
  2 (W-1)/W of the data (the bandwidth-optimal schedule). The rank that owns a chunk after
  the reduce-scatter applies ``avg``'s division, so every element is divided exactly once
  and all ranks end bitwise identical (float16 divides each rank's values before the sum
  instead, as the native ones do: :func:`overlap.comm.reduce_op.divides_first`).
* naive: every rank sends to the group's first rank, which reduces in rank order and sends
  the result back (reduce, then broadcast).

Any size works (chunks are ``torch.tensor_split``'s, empty chunks are skipped on every rank
alike), any world size from 1, and any op/dtype pair torch's in-place ops allow. Each call
takes the next tag of its group's counter, so concurrent ring allreduces never match each
other's messages (ranks call them in the same order, so the tags agree).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from overlap.comm import ordered as _ordered
from overlap.comm.p2p import ALGORITHM_TAGS
from overlap.comm.reduce_op import ReduceOp, check_reducible, divides_first, parse_op
from overlap.comm.steps import Steps

__all__ = ["ALGORITHMS", "check_algorithm_args", "naive_steps", "ring_steps"]

_TAG_BASE = ALGORITHM_TAGS.start
_TAG_SPAN = len(ALGORITHM_TAGS)  # stays below MPI's guaranteed tag bound (32767)
_counters: dict[tuple[int, ...], itertools.count[int]] = {}

_REDUCE: dict[ReduceOp, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    ReduceOp.SUM: lambda d, s: d.add_(s),
    ReduceOp.AVG: lambda d, s: d.add_(s),
    ReduceOp.PRODUCT: lambda d, s: d.mul_(s),
    ReduceOp.MIN: lambda d, s: torch.minimum(d, s, out=d),
    ReduceOp.MAX: lambda d, s: torch.maximum(d, s, out=d),
    ReduceOp.BAND: lambda d, s: d.bitwise_and_(s),
    ReduceOp.BOR: lambda d, s: d.bitwise_or_(s),
    ReduceOp.BXOR: lambda d, s: d.bitwise_xor_(s),
}


def _setup(tensor: Any, op: Any, group: Any) -> tuple[torch.Tensor, ReduceOp, list[int], int]:
    from overlap import comm

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError("tensor is not contiguous; pass tensor.contiguous()")
    rop = parse_op(op)
    check_reducible(rop, tensor.dtype)
    _check_local(rop, tensor.dtype, tensor.device)
    w = comm.get_world_size(group)
    ranks = [comm.get_global_rank(group, i) for i in range(w)]
    # detached, as the native path's: a Parameter's in-place sums failed half way through
    # the exchanges ("a view of a leaf Variable that requires grad"), the peer left waiting
    return tensor.detach().view(-1), rop, ranks, comm.get_rank(group)


_LOCAL_OK: dict[tuple[ReduceOp, torch.dtype, torch.device], str | None] = {}


def _check_local(rop: ReduceOp, dtype: torch.dtype, device: torch.device) -> None:
    """TypeError unless torch can apply ``rop`` to ``dtype`` tensors here, as the ring's
    and the naive root's local reductions do (on the ordered keys for a float max or min).

    Torch has no add or multiply for uint16/32/64 or float8 on the CPU. Before, the ring
    failed with torch's NotImplementedError ('"add_stub" not implemented for UInt16') in
    its first step, and with naive the root failed after its receives, leaving every
    other rank waiting for the result until the job timeout. Now every rank refuses the
    call before anything is sent. Tried once per (op, dtype, device)."""
    key = (rop, dtype, device)
    if key not in _LOCAL_OK:
        kd = _ordered.key_dtype(dtype) if _ordered.keyed(rop, dtype) else dtype
        try:
            a, b = torch.zeros(1, dtype=kd, device=device), torch.ones(1, dtype=kd, device=device)
            _REDUCE[rop](a, b)
            if rop is ReduceOp.AVG:
                a.div_(2)
            _LOCAL_OK[key] = None
        except (NotImplementedError, RuntimeError) as exc:
            _LOCAL_OK[key] = str(exc).splitlines()[0]
    why = _LOCAL_OK[key]
    if why is not None:
        raise TypeError(
            f"op={rop.value!r} on {dtype} tensors cannot run with algorithm='ring' or "
            f"'naive': torch cannot reduce them on {device.type} ({why}); convert the tensor "
            "to a dtype torch reduces (e.g. .to(torch.int64) or .to(torch.float16)), or use "
            "the backend's own all_reduce (algorithm='native') where it takes the dtype"
        )


def check_algorithm_args(tensor: Any, op: Any, group: Any) -> None:
    """Raise for bad input now (an async ring/naive allreduce runs on a driver thread)."""
    _setup(tensor, op, group)


def _backend() -> Any:
    """The active backend: the ring's messages use the reserved tags, which the public
    isend/irecv refuse."""
    from overlap.comm import state

    return state.active()


def _next_tag(ranks: list[int]) -> int:
    counter = _counters.setdefault(tuple(ranks), itertools.count())
    return _TAG_BASE + next(counter) % _TAG_SPAN


def ring_steps(tensor: torch.Tensor, op: Any = "sum", group: Any = None) -> Steps:
    """Ring allreduce of ``tensor`` in place; returns it."""

    flat, rop, ranks, r = _setup(tensor, op, group)
    w = len(ranks)
    if w == 1:
        return tensor
    work, keys, first = _prepare(flat, rop, w)
    tag = _next_tag(ranks)
    reduce = _REDUCE[rop]
    chunks = list(torch.tensor_split(work, w))
    nxt, prv = ranks[(r + 1) % w], ranks[(r - 1) % w]

    def exchange(send: torch.Tensor, recv: torch.Tensor) -> list[Any]:
        hs = []
        if recv.numel():
            hs.append(_backend().irecv(recv, prv, group, tag))
        if send.numel():
            hs.append(_backend().isend(send, nxt, group, tag))
        return hs

    # One receive buffer for every step: allocating a fresh one per step costs page faults
    # (32 MiB per step for a 64 MiB allreduce on 2 ranks).
    scratch = torch.empty(max(c.numel() for c in chunks), dtype=work.dtype, device=work.device)
    for s in range(w - 1):  # reduce-scatter
        into = chunks[(r - s - 1) % w]
        incoming = scratch[: into.numel()]
        yield exchange(chunks[(r - s) % w], incoming)
        reduce(into, incoming)
    owned = chunks[(r + 1) % w]
    if rop is ReduceOp.AVG and not first:
        owned.div_(w)
    for s in range(w - 1):  # all-gather
        yield exchange(chunks[(r + 1 - s) % w], chunks[(r - s) % w])
    if keys is not None:
        _ordered.from_keys(keys, flat)
    return tensor


def naive_steps(tensor: torch.Tensor, op: Any = "sum", group: Any = None) -> Steps:
    """Reduce to the group's first rank, then send the result back; in place."""

    flat, rop, ranks, r = _setup(tensor, op, group)
    w = len(ranks)
    if w == 1 or flat.numel() == 0:
        return tensor
    work, keys, first = _prepare(flat, rop, w)
    tag = _next_tag(ranks)
    root = ranks[0]
    if r == 0:
        incoming = [torch.empty_like(work) for _ in range(w - 1)]
        yield [_backend().irecv(buf, ranks[q + 1], group, tag) for q, buf in enumerate(incoming)]
        for buf in incoming:  # rank order: a deterministic result
            _REDUCE[rop](work, buf)
        if rop is ReduceOp.AVG and not first:
            work.div_(w)
        yield [_backend().isend(work, q, group, tag) for q in ranks[1:]]
    else:
        yield [_backend().isend(work, root, group, tag)]
        yield [_backend().irecv(work, root, group, tag)]
    if keys is not None:
        _ordered.from_keys(keys, flat)
    return tensor


def _prepare(
    flat: torch.Tensor, rop: ReduceOp, w: int
) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """(the tensor the algorithm reduces, its ordered keys or None, avg divided already?),
    as the native all_reduce does on gloo and MPI:

    * float16 ``avg`` divides each rank's values first (:func:`divides_first`);
    * a float max or min reduces ordered integer keys (:mod:`overlap.comm.ordered`), written
      back into ``flat`` at the end: torch.maximum/minimum pick between -0.0 and +0.0 by
      operand order, so ring and naive could end on the other zero than native."""
    first = divides_first(rop, flat.dtype)
    if first:
        flat.div_(w)
    keys = _ordered.to_keys(flat, rop) if _ordered.keyed(rop, flat.dtype) else None
    return (flat if keys is None else keys), keys, first


ALGORITHMS: dict[str, Callable[[torch.Tensor, Any, Any], Steps]] = {
    "ring": ring_steps,
    "naive": naive_steps,
}
