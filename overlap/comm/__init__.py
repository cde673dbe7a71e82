"""overlap.comm: the deepspeed.comm-style communication API, awaitable.

Use it like ``import deepspeed.comm as dist``::

    from overlap import comm
    overlap.init_distributed()
    comm.all_reduce(t)                       # blocking
    h = comm.all_reduce(t, async_op=True)    # a Handle
    t = await h                              # or h.wait()

Every function delegates to the backend chosen by :func:`init_distributed`. Collectives
block by default and return a :class:`Handle` with ``async_op=True``; ``isend``/``irecv``
always return a Handle. Ranks (``src``, ``dst``, ``peer``) are global ranks, and ``group``
is ``None`` (the world) or a group from :func:`new_group`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from overlap.comm import debug as _debug
from overlap.comm import state
from overlap.comm.groups import NonMemberGroup
from overlap.comm.handle import Handle, HandleState
from overlap.comm.init import destroy_process_group, init_distributed
from overlap.comm.p2p import P2POp, check_tag
from overlap.comm.reduce_op import ReduceOp, parse_op

__all__ = [
    "Handle",
    "HandleState",
    "NonMemberGroup",
    "P2POp",
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "destroy_process_group",
    "gather",
    "get_backend",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "init_distributed",
    "irecv",
    "is_initialized",
    "isend",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
]


def _check(op: str, group: Any, tensors: list[Any]) -> None:
    if _debug.enabled():
        _debug.check(op, group, tensors)


def _opname(op: Any) -> str:
    """A reduce op as the debug fingerprint spells it (so "sum" and ReduceOp.SUM agree)."""
    try:
        return parse_op(op).name.lower()
    except Exception:
        return repr(op)


# ------------------------------------------------------------------------ process, groups
def is_initialized() -> bool:
    """True after :func:`init_distributed` (and before :func:`destroy_process_group`)."""
    return state.is_active()


def get_backend() -> str:
    """The active backend's name: ``"gloo"``, ``"nccl"`` (or ``"mpi"``)."""
    name: str = state.active().name
    return name


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (the world by default)."""
    r: int = state.active().get_rank(group)
    return r


def get_world_size(group: Any = None) -> int:
    """The number of ranks in ``group`` (the world by default)."""
    n: int = state.active().get_world_size(group)
    return n


def get_local_rank() -> int:
    """This process's rank on its host (LOCAL_RANK from torchrun, or discovered under MPI)."""
    return state.local_rank()


def get_global_rank(group: Any, group_rank: int) -> int:
    """The global rank of ``group``'s member number ``group_rank``."""
    r: int = state.active().get_global_rank(group, group_rank)
    return r


def get_world_group() -> Any:
    """The group of all ranks (``None`` also means it everywhere)."""
    state.active()
    return None


def new_group(ranks: Sequence[int] | None = None, **kwargs: Any) -> Any:
    """A group of the given global ranks. Every rank must call it, members or not.

    Members get a process group; other ranks get a :class:`NonMemberGroup` whose use raises
    a ValueError naming the members.
    """
    backend = state.active()
    group = backend.new_group(ranks, **kwargs)
    world = backend.get_world_size()
    members = sorted(range(world) if ranks is None else {int(r) for r in ranks})
    if _debug.enabled() and not kwargs.get("use_local_synchronization"):
        # debug mode's own group for this one, made now while every rank is here
        _debug.make_group(group, lambda: backend.new_group(members, **kwargs))
    if len(members) < world and not kwargs.get("use_local_synchronization"):
        # its private twin for async multi-phase ops (overlap.comm.driver), made now while
        # every rank is here
        from overlap.comm import driver

        driver.make_twin(group, members, lambda: backend.new_group(members, **kwargs))
    return group


# ---------------------------------------------------------------------------- collectives
def all_reduce(
    tensor: torch.Tensor,
    op: Any = "sum",
    group: Any = None,
    async_op: bool = False,
    algorithm: str = "native",
) -> Any:
    """Reduce ``tensor`` across the group, in place, on every rank.

    ``op``: "sum", "avg", "product", "min", "max" (also "band", "bor", "bxor"), or a
    ReduceOp. "avg" works on gloo too (a sum, then a division before completion).
    ``algorithm``: "native" (the backend's own), or "ring" / "naive", built from awaitable
    isend/irecv (see overlap.comm.algorithms).
    Returns the tensor (or a Handle resolving to it with ``async_op=True``).
    """
    backend = state.active()
    if _debug.enabled():
        _debug.check(f"all_reduce[{algorithm}] op={_opname(op)}", group, [tensor])
    if algorithm == "native":
        return backend.all_reduce(tensor, op, group, async_op)
    from overlap.comm.algorithms import ALGORITHMS, check_algorithm_args
    from overlap.comm.steps import run

    make = ALGORITHMS.get(algorithm)
    if make is None:
        raise ValueError(f"unknown algorithm {algorithm!r}; use 'native', 'ring' or 'naive'")
    if not async_op:
        return run(make(tensor, op, group))
    from overlap.comm import driver

    check_algorithm_args(tensor, op, group)  # bad input raises here, not from the handle
    return driver.submit(
        f"all_reduce[{algorithm}]",
        lambda twin: make(tensor, op, twin),
        group,
        nbytes=tensor.numel() * tensor.element_size(),
        backend=backend.name,
        device=tensor.device,
    )


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    """Copy rank ``src``'s tensor into ``tensor`` on every rank of the group."""
    _check(f"broadcast src={src}", group, [tensor])
    return state.active().broadcast(tensor, src, group, async_op)


def reduce(
    tensor: torch.Tensor, dst: int, op: Any = "sum", group: Any = None, async_op: bool = False
) -> Any:
    """Reduce into ``tensor`` on rank ``dst``; other ranks' tensors are left unchanged.

    (gloo itself leaves partial results there; overlap restores them, as deepspeed.comm
    documents, at the cost of one copy of the tensor on non-destination ranks.)
    """
    _check(f"reduce dst={dst} op={_opname(op)}", group, [tensor])
    return state.active().reduce(tensor, dst, op, group, async_op)


def all_gather(
    tensor_list: Any, tensor: torch.Tensor | None = None, group: Any = None, async_op: bool = False
) -> Any:
    """Gather every rank's tensor.

    Two forms: ``all_gather(tensor_list, tensor)`` fills ``tensor_list`` (torch's form), and
    ``all_gather(tensor)`` allocates and returns the list. Either returns the list (or a Handle
    resolving to it).
    """
    _check("all_gather", group, [tensor_list, tensor])
    return state.active().all_gather(tensor_list, tensor, group, async_op)


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """Concatenate every rank's ``input_tensor`` into ``output_tensor`` (world_size x input)."""
    _check("all_gather_into_tensor", group, [output_tensor, input_tensor])
    return state.active().all_gather_into_tensor(output_tensor, input_tensor, group, async_op)


def reduce_scatter(
    output: torch.Tensor, input: Any, op: Any = "sum", group: Any = None, async_op: bool = False
) -> Any:
    """Reduce, then give rank i the i-th chunk in ``output``.

    ``input`` is a list of world_size tensors shaped like ``output``, or one flat tensor of
    world_size x output elements.
    """
    _check(f"reduce_scatter op={_opname(op)}", group, [output, input])
    return state.active().reduce_scatter(output, input, op, group, async_op)


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Any = "sum",
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """reduce_scatter with one flat input tensor (torch's name for that form)."""
    if not isinstance(input, torch.Tensor):
        raise TypeError(
            "reduce_scatter_tensor takes one input tensor; use reduce_scatter for a list"
        )
    return state.active().reduce_scatter(output, input, op, group, async_op)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """Split ``input`` along dim 0, send chunk i to rank i, gather the received chunks."""
    _check("all_to_all_single", group, [output, input])
    return state.active().all_to_all_single(
        output, input, output_split_sizes, input_split_sizes, group, async_op
    )


def all_to_all(
    output_tensor_list: Any, input_tensor_list: Any, group: Any = None, async_op: bool = False
) -> Any:
    """Send ``input_tensor_list[i]`` to rank i; receive rank i's into ``output_tensor_list[i]``."""
    _check("all_to_all", group, [output_tensor_list, input_tensor_list])
    return state.active().all_to_all(output_tensor_list, input_tensor_list, group, async_op)


def gather(
    tensor: torch.Tensor,
    gather_list: Any = None,
    dst: int = 0,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """Collect every rank's tensor into ``gather_list`` on ``dst`` (returns it there, else None)."""
    _check(f"gather dst={dst}", group, [tensor])
    return state.active().gather(tensor, gather_list, dst, group, async_op)


def scatter(
    tensor: torch.Tensor,
    scatter_list: Any = None,
    src: int = 0,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """Give rank i ``scatter_list[i]`` from ``src``, received into ``tensor``."""
    _check(f"scatter src={src}", group, [tensor])
    return state.active().scatter(tensor, scatter_list, src, group, async_op)


def barrier(group: Any = None, async_op: bool = False) -> Any:
    """Wait until every rank of the group reaches the barrier."""
    _check("barrier", group, [])
    return state.active().barrier(group, async_op)


# -------------------------------------------------------------------------- point to point
def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> None:
    """Send ``tensor`` to rank ``dst`` and wait until it is handed over."""
    if tag:
        check_tag(tag)
    state.active().send(tensor, dst, group, tag)


def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> int:
    """Receive into ``tensor`` from ``src`` (any rank if None); returns the sender's rank."""
    if tag:
        check_tag(tag)
    r: int = state.active().recv(tensor, src, group, tag)
    return r


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> Handle:
    """Start sending ``tensor`` to ``dst``; the Handle resolves to ``tensor``.

    Tags 20000-29999 are reserved (overlap's ring and naive allreduce use them)."""
    if tag:
        check_tag(tag)
    h: Handle = state.active().isend(tensor, dst, group, tag)
    return h


def irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> Handle:
    """Start receiving into ``tensor``; the Handle resolves to ``tensor``.

    To give up waiting, time out the *await* (``asyncio.wait_for``) or pass a timeout to
    ``wait``: the receive itself stays posted and keeps the tensor.
    """
    if tag:
        check_tag(tag)
    h: Handle = state.active().irecv(tensor, src, group, tag)
    return h


def batch_isend_irecv(p2p_op_list: Sequence[Any]) -> list[Handle]:
    """Start several sends and receives at once; one Handle per op, in order.

    Takes :class:`P2POp` (``torch.distributed.P2POp`` works too).
    """
    for p in p2p_op_list:
        check_tag(getattr(p, "tag", 0) or 0)
    handles: list[Handle] = state.active().batch_isend_irecv(p2p_op_list)
    return handles
