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

The names, positional order, keywords and defaults are deepspeed.comm's (docs/api.md has the
migration table and the few differences). ``prof``, ``log_name`` and ``debug`` feed the comms
logger (:mod:`overlap.comm.comms_logger`); while it is off they cost one attribute read.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed import GradBucket  # type: ignore[attr-defined]

from overlap.comm import claims as _claims
from overlap.comm import comms_logger as _logger
from overlap.comm import debug as _debug
from overlap.comm import state
from overlap.comm.backend_names import backend_name
from overlap.comm.collect import collect_all
from overlap.comm.comms_logger import (
    BYPASS,
    configure,
    get_comm_operation_count,
    get_logged_comm_ops,
    has_comm_data,
    log_summary,
    reset_log,
    timed_op,
)
from overlap.comm.compat import (
    Noop,
    ProcessGroup,
    all_gather_comm_off,
    all_reduce_comm_off,
    backward_comm_off,
    broadcast_comm_off,
    comm_off,
    enable_symm_mem_for_group,
    has_all_gather_into_tensor,
    has_all_reduce_coalesced,
    has_coalescing_manager,
    has_reduce_scatter_tensor,
    init_deepspeed_backend,
    initialize_mesh_device,
    is_available,
    reduce_comm_off,
    reduce_scatter_comm_off,
    set_backend,
    skipped,
)
from overlap.comm.constants import *  # noqa: F403  (deepspeed.comm's constants)
from overlap.comm.constants import __all__ as _constants
from overlap.comm.groups import NonMemberGroup
from overlap.comm.handle import Handle, HandleState
from overlap.comm.init import destroy_process_group, init_distributed, mpi_discovery
from overlap.comm.p2p import P2POp, check_tag
from overlap.comm.reduce_op import ReduceOp, parse_op
from overlap.comm.torch_names import (
    get_group_rank,
    get_node_local_rank,
    get_process_group_ranks,
    is_gloo_available,
    is_mpi_available,
    is_nccl_available,
    is_torchelastic_launched,
    new_subgroups,
    new_subgroups_by_enumeration,
)
from overlap.comm.validate import check_batch_buffers, check_splits

__all__ = [
    "GradBucket",
    "Handle",
    "HandleState",
    "NonMemberGroup",
    "Noop",
    "P2POp",
    "ProcessGroup",
    "ReduceOp",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_comm_off",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_single",
    "all_reduce",
    "all_reduce_coalesced",
    "all_reduce_comm_off",
    "all_to_all",
    "all_to_all_single",
    "allgather_fn",
    "backward_comm_off",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_comm_off",
    "broadcast_object_list",
    "collect_all",
    "configure",
    "destroy_process_group",
    "enable_symm_mem_for_group",
    "gather",
    "gather_object",
    "get_all_ranks_from_group",
    "get_backend",
    "get_comm_operation_count",
    "get_global_rank",
    "get_group_rank",
    "get_local_rank",
    "get_local_world_size",
    "get_logged_comm_ops",
    "get_node_local_rank",
    "get_node_rank",
    "get_process_group_ranks",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "has_all_gather_into_tensor",
    "has_all_reduce_coalesced",
    "has_coalescing_manager",
    "has_comm_data",
    "has_reduce_scatter_tensor",
    "inference_all_reduce",
    "init_deepspeed_backend",
    "init_distributed",
    "initialize_mesh_device",
    "irecv",
    "is_available",
    "is_gloo_available",
    "is_initialized",
    "is_mpi_available",
    "is_nccl_available",
    "is_torchelastic_launched",
    "isend",
    "log_summary",
    "monitored_barrier",
    "mpi_discovery",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "recv",
    "recv_object_list",
    "reduce",
    "reduce_comm_off",
    "reduce_scatter",
    "reduce_scatter_comm_off",
    "reduce_scatter_fn",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "reset_log",
    "scatter",
    "scatter_object_list",
    "send",
    "sendrecv",
    "send_object_list",
    "set_backend",
    "timed_op",
    *_constants,
]

_LOG = _logger.LOGGER


def _check(op: str, group: Any, tensors: list[Any]) -> None:
    if _debug.enabled():
        _debug.check(op, group, tensors)


def _split_counts(t: Any, splits: Sequence[int] | None, w: int) -> list[int]:
    """Elements an all_to_all_single sends to (or expects from) each rank; -1s where the
    arguments are bad (the backend's own check raises, after the debug exchange)."""
    if not isinstance(t, torch.Tensor):
        return [-1] * w
    try:
        rows = check_splits(t, splits, "", w)
    except (ValueError, TypeError):
        return [-1] * w
    row = math.prod(t.shape[1:])
    return [_debug.count(s * row, t.dtype) for s in rows]


def _list_counts(ts: Any, w: int) -> list[int]:
    """Elements an all_to_all sends to (or expects from) each rank (-1s if ``ts`` is bad)."""
    if not isinstance(ts, (list, tuple)) or len(ts) != w:
        return [-1] * w
    return [_debug.count(t.numel(), t.dtype) if isinstance(t, torch.Tensor) else -1 for t in ts]


def _opname(op: Any) -> str:
    """A reduce op as the debug fingerprint spells it (so "sum" and ReduceOp.SUM agree)."""
    try:
        return parse_op(op).name.lower()
    except Exception:
        return repr(op)


# ------------------------------------------------------------------------ process, groups
def _claim(h: Any, async_op: bool, name: str, writes: Any, reads: Any = ()) -> Any:
    """``h``, an async op's handle, claiming its tensors until it completes
    (:mod:`overlap.comm.claims`); anything else (a blocking op's result) as it is."""
    if async_op and isinstance(h, Handle):
        _claims.claim(h, name, writes, reads)
    return h


def _in_order(name: str, writes: Any, reads: Any, async_op: bool, issue: Any) -> Any:
    """``issue()`` once no collective in flight writes what it touches (or reads what it
    writes), its handle then claiming ``writes`` and ``reads`` (:mod:`overlap.comm.claims`):
    the one way the collectives below go to their backend."""
    if _claims.live:
        _claims.settle(name, writes, reads)
    return _claim(issue(), async_op, name, writes, reads)


def _is_me(rank: Any) -> bool:
    """Whether global rank ``rank`` is this process (the root of a broadcast or scatter
    only reads its tensor, the destination of a gather writes its list)."""
    b = state._backend
    return b is not None and rank == b.get_rank()


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


def get_local_world_size() -> int:
    """How many processes of the job run on this host: LOCAL_WORLD_SIZE from torchrun (or
    LOCAL_SIZE from the DeepSpeed launcher), srun's or horovodrun's own, the processor names
    under MPI, else the world size (one host assumed)."""
    return state.local_world_size()


def get_node_rank() -> int:
    """This host's index in the job (0 for the host of rank 0): GROUP_RANK (or NODE_RANK)
    from torchrun (CROSS_RANK from the DeepSpeed launcher), srun's or horovodrun's own, the
    processor names under MPI, else 0."""
    return state.node_rank()


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    """The global rank of ``group``'s member number ``group_rank``."""
    r: int = state.active().get_global_rank(group, group_rank)
    return r


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    """The global ranks of ``group``'s members, in group-rank order."""
    return [get_global_rank(group, i) for i in range(get_world_size(group))]


def get_world_group() -> Any:
    """The group of all ranks (``None`` also means it everywhere)."""
    state.active()
    return None


def new_group(ranks: Sequence[int] | None = None, **kwargs: Any) -> Any:
    """A group of the given global ranks. Every rank must call it, members or not.

    Members get a process group; other ranks get a :class:`NonMemberGroup` whose use raises
    a ValueError naming the members.

    Every group runs on the job's backend: ``backend=`` naming another (a gloo group for CPU
    tensors in an NCCL job, say) is refused here, on every rank and before any group is
    made. Why: a backend's ops complete in their own way (NCCL's on CUDA streams, gloo's
    p2p on waiter threads), and the tensors' device is checked against the job's backend,
    so such a group's first op failed with a misleading device error (seen on an H100).
    """
    backend = state.active()
    other = kwargs.get("backend")
    if other is not None and backend_name(other) != backend.name:
        raise ValueError(
            f"new_group: backend={other!r} differs from this job's backend {backend.name!r}; "
            "overlap runs every group of a job on the job's backend. Leave backend= out, and "
            "for CPU tensors in an NCCL job move them to CUDA (t.cuda()) or run the job on "
            "gloo (init_distributed('gloo'))"
        )
    if ranks is not None:
        # read once (a generator was used up by the backend, and the twin then got no
        # ranks); global ranks are ints: int("01"[i]) or int(0.0) made a group of a typo
        if isinstance(ranks, (str, bytes)):
            raise TypeError(f"new_group: ranks must be a sequence of ints, got {ranks!r}")
        ranks = list(ranks)
        bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, numbers.Integral)]
        if bad:
            raise TypeError(
                f"new_group: ranks must be ints (global ranks), got {bad[:3]!r} in {ranks!r}"
            )
    world = backend.get_world_size()
    if world > 1 and not kwargs.get("use_local_synchronization"):
        # every rank says what it passed before any group is made (overlap.comm.members)
        from overlap.comm.members import agree_on_members
        from overlap.comm.objects import _device

        agree_on_members(list(range(world)) if ranks is None else ranks, world, _device())
    group = backend.new_group(ranks, **kwargs)
    members = sorted(range(world) if ranks is None else {int(r) for r in ranks})
    # Its debug group and its private twin for async multi-phase ops (overlap.comm.driver)
    # are made now, while every rank is here. A member-only group
    # (use_local_synchronization=True) gets neither: torch names such a group by its ranks
    # alone, so a second one of the same ranks would share the first one's name (and its
    # store keys).
    if _debug.enabled() and not kwargs.get("use_local_synchronization"):
        # debug mode's own group for this one, made now while every rank is here
        _debug.make_group(group, lambda: backend.new_group(members, **kwargs))
    if len(members) < world and not kwargs.get("use_local_synchronization"):
        from overlap.comm import driver

        driver.make_twin(group, members, lambda: backend.new_group(members, **kwargs))
    return group


# ---------------------------------------------------------------------------- collectives
def all_reduce(
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_reduce",
    debug: str | None = None,
    algorithm: str = "native",
) -> Any:
    """Reduce ``tensor`` across the group, in place, on every rank.

    ``op``: "sum", "avg", "product", "min", "max" (also "band", "bor", "bxor"), or a
    ReduceOp. "avg" works on gloo and MPI too (a sum, then a division before completion;
    float16 sums each rank's divided share, as NCCL does, so it cannot overflow where the
    average fits).
    ``algorithm``: "native" (the backend's own), or "ring" / "naive", built from awaitable
    isend/irecv (see overlap.comm.algorithms).
    Returns the tensor (or a Handle resolving to it with ``async_op=True``).
    """
    b = state._backend
    if _claims.live:
        _claims.settle1("all_reduce", tensor, True)
    if b is not None and not _LOG.enabled and not _debug._enabled and algorithm == "native":
        # the common call, straight to the backend (the same call as below, with fewer
        # checks on the way: 0.45 us of an 8-byte MPI call's 6.0 on 2 ranks went here)
        h = b.all_reduce(tensor, op, group, async_op)
        if async_op:
            _claims.claim1(h, "all_reduce", tensor, True)
        return h
    if _LOG.enabled and _LOG.wants(prof, log_name):
        return _LOG.timed(
            "all_reduce",
            log_name,
            debug,
            lambda a: all_reduce(tensor, op, group, a, log_name=BYPASS, algorithm=algorithm),
            async_op,
        )
    backend = state.active()
    if _debug._enabled:
        _debug.check(f"all_reduce[{algorithm}] op={_opname(op)}", group, [tensor])
    if algorithm == "native":  # (settled above, as every form of all_reduce is)
        h = backend.all_reduce(tensor, op, group, async_op)
        return _claim(h, async_op, "all_reduce", (tensor,))
    from overlap.comm.algorithms import ALGORITHMS, check_algorithm_args
    from overlap.comm.steps import run

    make = ALGORITHMS.get(algorithm)
    if make is None:
        raise ValueError(f"unknown algorithm {algorithm!r}; use 'native', 'ring' or 'naive'")
    if not async_op:
        return run(make(tensor, op, group))
    from overlap.comm import driver

    check_algorithm_args(tensor, op, group)  # bad input raises here, not from the handle
    h = driver.submit(
        f"all_reduce[{algorithm}]",
        lambda twin: make(tensor, op, twin),
        group,
        nbytes=tensor.numel() * tensor.element_size(),
        backend=backend.name,
        device=tensor.device,
        world=backend.get_world_size(group),
    )
    return _claim(h, True, f"all_reduce[{algorithm}]", (tensor,))


def inference_all_reduce(
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_reduce",
    debug: str | None = None,
) -> Any:
    """:func:`all_reduce` (DeepSpeed's name for the allreduce of inference, which it may run
    through a shared-memory kernel on one host; overlap runs the backend's own)."""
    return all_reduce(tensor, op, group, async_op, prof, log_name, debug)


def all_reduce_coalesced(
    tensors: Sequence[torch.Tensor],
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_reduce",
    debug: str | None = None,
) -> Any:
    """All-reduce several tensors in place with one collective per dtype and device
    (:mod:`overlap.comm.coalesced`). Returns the list (or a Handle resolving to it)."""
    if _LOG.enabled and _LOG.wants(prof, log_name):
        return _LOG.timed(
            "all_reduce_coalesced",
            log_name,
            debug,
            lambda a: all_reduce_coalesced(tensors, op, group, a, log_name=BYPASS),
            async_op,
        )
    from overlap.comm.coalesced import all_reduce_coalesced_steps, check_tensors
    from overlap.comm.reduce_op import check_reducible

    ts = check_tensors("tensors", tensors)
    rop = parse_op(op)
    for t in ts:
        check_reducible(rop, t.dtype)
    _check(f"all_reduce_coalesced op={_opname(op)}", group, [ts])
    nbytes = sum(t.numel() * t.element_size() for t in ts)
    return _in_order(
        "all_reduce_coalesced", ts, (), async_op,
        lambda: _steps_op(
            "all_reduce_coalesced", lambda g: all_reduce_coalesced_steps(ts, rop, g), group,
            async_op, nbytes, ts[0].device if ts else None,
        ),
    )  # fmt: skip


def _steps_op(name: str, make: Any, group: Any, async_op: bool, nbytes: int, device: Any) -> Any:
    """Run a steps generator here (blocking) or on the group's driver (a Handle)."""
    backend = state.active()
    if not async_op:
        from overlap.comm.steps import run

        return run(make(group))
    from overlap.comm import driver

    return driver.submit(
        name,
        make,
        group,
        nbytes=nbytes,
        backend=backend.name,
        device=device,
        world=backend.get_world_size(group),
    )


def _maybe_timed(
    name: str, prof: bool, log_name: str, debug: str | None, group: Any, call: Any
) -> Any:
    """Run a blocking op that moves no tensor of the caller's (the object collectives,
    monitored_barrier), timed by the comms logger when it wants this call; its result."""
    if _LOG.enabled and _LOG.wants(prof, log_name):
        return _LOG.timed_call(name, log_name, debug, call, 0, get_world_size(group), depth=4)
    return call()


def broadcast(
    tensor: torch.Tensor,
    src: int,
    group: Any = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "broadcast",
    debug: str | None = None,
) -> Any:
    """Copy rank ``src``'s tensor into ``tensor`` on every rank of the group."""
    b = state._backend
    # the root reads its tensor, every other rank writes it (asked only where it matters)
    writes = not _is_me(src) if async_op or _claims.live else True
    if _claims.live:
        _claims.settle1("broadcast", tensor, writes)
    if b is not None and not _LOG.enabled and not _debug._enabled and not comm_off:
        h = b.broadcast(tensor, src, group, async_op)  # the common call (all_reduce's)
        if async_op:
            _claims.claim1(h, "broadcast", tensor, writes)
        return h
    if _LOG.enabled and _LOG.wants(prof, log_name):
        return _LOG.timed(
            "broadcast",
            log_name,
            debug,
            lambda a: broadcast(tensor, src, group, a, log_name=BYPASS),
            async_op,
        )
    if comm_off and "broadcast" in comm_off:
        return skipped("broadcast")
    _check(f"broadcast src={src}", group, [tensor])
    h = state.active().broadcast(tensor, src, group, async_op)
    if async_op and isinstance(h, Handle):
        _claims.claim1(h, "broadcast", tensor, writes)
    return h


def broadcast_object_list(
    object_list: list[Any], src: int, group: Any = None, device: Any = None
) -> None:
    """Replace ``object_list``'s elements with rank ``src``'s (picklable objects; every rank
    passes a list of the same length). Blocking; uses pickle (:mod:`overlap.comm.objects`)."""
    from overlap.comm.objects import broadcast_object_list as impl

    _maybe_timed(
        "broadcast_object_list", False, "broadcast_object_list", None, group,
        lambda: impl(object_list, src, group, device),
    )  # fmt: skip


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "reduce",
    debug: str | None = None,
) -> Any:
    """Reduce into ``tensor`` on rank ``dst``; other ranks' tensors are left unchanged.

    (gloo itself leaves partial results there; overlap restores them, as deepspeed.comm
    documents, at the cost of one copy of the tensor on non-destination ranks.)
    """
    if _LOG.enabled and _LOG.wants(prof, log_name):
        return _LOG.timed(
            "reduce",
            log_name,
            debug,
            lambda a: reduce(tensor, dst, op, group, a, log_name=BYPASS),
            async_op,
        )
    if comm_off and "reduce" in comm_off:
        return skipped("reduce")
    # gloo writes partial sums into every rank's tensor (overlap puts them back), MPI only
    # into the destination's
    ro = not _is_me(dst) and get_backend() == "mpi"
    roles: tuple[Any, Any] = ((), (tensor,)) if ro else ((tensor,), ())
    _check(f"reduce dst={dst} op={_opname(op)}", group, [tensor])
    return _in_order(
        "reduce", *roles, async_op, lambda: state.active().reduce(tensor, dst, op, group, async_op)
    )


def all_gather(
    tensor_list: Any,
    tensor: torch.Tensor | None = None,
    group: Any = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_gather",
    debug: str | None = None,
) -> Any:
    """Gather every rank's tensor.

    Two forms: ``all_gather(tensor_list, tensor)`` fills ``tensor_list`` (torch's form), and
    ``all_gather(tensor)`` allocates and returns the list. Either returns the list (or a Handle
    resolving to it).
    """
    if _LOG.enabled and _LOG.wants(prof, log_name):
        return _LOG.timed(
            "all_gather",
            log_name,
            debug,
            lambda a: all_gather(tensor_list, tensor, group, a, log_name=BYPASS),
            async_op,
        )
    if comm_off and "all_gather" in comm_off:
        return skipped("all_gather")
    # the one-tensor form allocates its outputs
    roles: tuple[Any, Any] = ((), (tensor_list,)) if tensor is None else (tensor_list, (tensor,))
    _check("all_gather", group, [tensor_list, tensor])
    return _in_order(
        "all_gather", *roles, async_op,
        lambda: state.active().all_gather(tensor_list, tensor, group, async_op),
    )  # fmt: skip


def all_gather_object(
    object_list: list[Any],
    obj: Any,
    group: Any = None,
    prof: bool = False,
    log_name: str = "all_gather_object",
    debug: str | None = None,
) -> None:
    """Fill ``object_list`` (``[None] * world_size``) with every rank's picklable ``obj``.
    Blocking; uses pickle (:mod:`overlap.comm.objects`)."""
    from overlap.comm.objects import all_gather_object as impl

    _maybe_timed(
        "all_gather_object", prof, log_name, debug, group, lambda: impl(object_list, obj, group)
    )


def _objects(name: str, group: Any, *args: Any) -> Any:
    """Run :mod:`overlap.comm.objects`' ``name`` on ``args`` through the comms logger, for
    torch's object calls (their signatures take none of DeepSpeed's logger options)."""
    from overlap.comm import objects

    impl = getattr(objects, name)
    return _maybe_timed(name, False, name, None, group, lambda: impl(*args))


def gather_object(
    obj: Any, object_gather_list: list[Any] | None = None, dst: int = 0, group: Any = None
) -> None:
    """Fill ``object_gather_list`` (``[None] * world_size``) on rank ``dst`` with every
    rank's picklable ``obj`` (torch's ``gather_object``). Blocking; uses pickle
    (:mod:`overlap.comm.objects`)."""
    _objects("gather_object", group, obj, object_gather_list, dst, group)


def send_object_list(
    object_list: list[Any], dst: int, group: Any = None, device: Any = None
) -> None:
    """Send ``object_list``'s picklable objects to rank ``dst`` for its
    :func:`recv_object_list` (torch's ``send_object_list``). Blocking; uses pickle
    (:mod:`overlap.comm.objects`)."""
    _objects("send_object_list", group, object_list, dst, group, device)


def recv_object_list(
    object_list: list[Any], src: int | None = None, group: Any = None, device: Any = None
) -> int:
    """Receive rank ``src``'s :func:`send_object_list` (any rank's if None) into
    ``object_list`` (one slot per object sent); returns the sender's rank (torch's
    ``recv_object_list``). Blocking; uses pickle (:mod:`overlap.comm.objects`)."""
    sender: int = _objects("recv_object_list", group, object_list, src, group, device)
    return sender


def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int = 0,
    group: Any = None,
) -> None:
    """Put rank ``src``'s ``scatter_object_input_list[i]`` into
    ``scatter_object_output_list[0]`` on group rank i (torch's ``scatter_object_list``).
    Blocking; uses pickle (:mod:`overlap.comm.objects`)."""
    _objects(
        "scatter_object_list", group,
        scatter_object_output_list, scatter_object_input_list, src, group,
    )  # fmt: skip


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_gather_into_tensor",
    debug: str | None = None,
) -> Any:
    """Concatenate every rank's ``tensor`` into ``output_tensor`` (world_size x tensor)."""
    if _LOG.enabled and _LOG.wants(prof, log_name):
        return _LOG.timed(
            "all_gather_into_tensor",
            log_name,
            debug,
            lambda a: all_gather_into_tensor(output_tensor, tensor, group, a, log_name=BYPASS),
            async_op,
        )
    _check("all_gather_into_tensor", group, [output_tensor, tensor])
    return _in_order(
        "all_gather_into_tensor", (output_tensor,), (tensor,), async_op,
        lambda: state.active().all_gather_into_tensor(output_tensor, tensor, group, async_op),
    )  # fmt: skip


def allgather_fn(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
    debug: str | None = None,
) -> Any:
    """:func:`all_gather_into_tensor` (DeepSpeed's helper, which falls back to a list
    all_gather on torch builds without it; every overlap backend has it)."""
    return all_gather_into_tensor(output_tensor, input_tensor, group, async_op, debug=debug)


def all_gather_coalesced(
    output_tensors: Sequence[torch.Tensor],
    input_tensors: Sequence[torch.Tensor],
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """For each i, all-gather ``input_tensors[i]`` into ``output_tensors[i]`` (world_size x
    its elements, contiguous), with one collective per dtype and device. Returns the outputs
    (or a Handle resolving to them)."""
    from overlap.comm.coalesced import all_gather_coalesced_steps, check_gather

    w = get_world_size(group)
    outs, ins = check_gather(output_tensors, input_tensors, w)

    def issue(a: bool) -> Any:
        _check("all_gather_coalesced", group, [outs, ins])
        return _in_order(
            "all_gather_coalesced", outs, ins, a,
            lambda: _steps_op(
                "all_gather_coalesced", lambda g: all_gather_coalesced_steps(outs, ins, g),
                group, a, sum(t.numel() * t.element_size() for t in ins),
                ins[0].device if ins else None,
            ),
        )  # fmt: skip

    if _LOG.enabled and _LOG.wants(False, "all_gather_coalesced"):
        return _LOG.timed("all_gather_coalesced", "all_gather_coalesced", None, issue, async_op)
    return issue(async_op)


def reduce_scatter(
    output: torch.Tensor,
    input_list: Any,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "reduce_scatter",
    debug: str | None = None,
) -> Any:
    """Reduce, then give rank i the i-th chunk in ``output``.

    ``input_list`` is a list of world_size tensors shaped like ``output``, or one flat tensor
    of world_size x output elements.
    """
    if _LOG.enabled and _LOG.wants(prof, log_name):
        return _LOG.timed(
            "reduce_scatter",
            log_name,
            debug,
            lambda a: reduce_scatter(output, input_list, op, group, a, log_name=BYPASS),
            async_op,
        )
    if comm_off and "reduce_scatter" in comm_off:
        return skipped("reduce_scatter")
    ins = (input_list,) if isinstance(input_list, torch.Tensor) else input_list
    _check(f"reduce_scatter op={_opname(op)}", group, [output, input_list])
    return _in_order(
        "reduce_scatter", (output,), ins, async_op,
        lambda: state.active().reduce_scatter(output, input_list, op, group, async_op),
    )  # fmt: skip


def reduce_scatter_tensor(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "reduce_scatter_tensor",
    debug: str | None = None,
) -> Any:
    """reduce_scatter with one flat input tensor (torch's name for that form)."""
    if _LOG.enabled and _LOG.wants(prof, log_name):
        return _LOG.timed(
            "reduce_scatter_tensor",
            log_name,
            debug,
            lambda a: reduce_scatter_tensor(output_tensor, tensor, op, group, a, log_name=BYPASS),
            async_op,
        )
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            "reduce_scatter_tensor takes one input tensor; use reduce_scatter for a list"
        )
    # reduce_scatter's own check (it takes the flat form too): in debug mode a rank whose
    # dtype or size differed ended every rank from gloo's thread before the forty-sixth
    # session ("Received data size doesn't match expected size")
    _check(f"reduce_scatter op={_opname(op)}", group, [output_tensor, tensor])
    return _in_order(
        "reduce_scatter_tensor", (output_tensor,), (tensor,), async_op,
        lambda: state.active().reduce_scatter(output_tensor, tensor, op, group, async_op),
    )  # fmt: skip


def reduce_scatter_fn(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    prof: bool = False,
    debug: str | None = None,
) -> Any:
    """:func:`reduce_scatter_tensor` (DeepSpeed's helper, which falls back to a list
    reduce_scatter on torch builds without it; every overlap backend has it)."""
    return reduce_scatter_tensor(output_tensor, tensor, op, group, async_op, prof, debug=debug)


# torch's newer names (torch.distributed.all_gather_single / reduce_scatter_single) for the
# same ops, with the same arguments
all_gather_single = all_gather_into_tensor
reduce_scatter_single = reduce_scatter_tensor


def all_to_all_single(
    output: torch.Tensor,
    tensor: torch.Tensor,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: Any = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_to_all_single",
    debug: str | None = None,
) -> Any:
    """Split ``tensor`` along dim 0, send chunk i to rank i, gather the received chunks."""
    if _LOG.enabled and _LOG.wants(prof, log_name):
        return _LOG.timed(
            "all_to_all_single",
            log_name,
            debug,
            lambda a: all_to_all_single(
                output, tensor, output_split_sizes, input_split_sizes, group, a, log_name=BYPASS
            ),
            async_op,
        )
    if _debug.enabled():
        w = get_world_size(group)
        sends = _split_counts(tensor, input_split_sizes, w)
        expects = _split_counts(output, output_split_sizes, w)
        _debug.check("all_to_all_single", group, [output, tensor], (sends, expects))
    return _in_order(
        "all_to_all_single", (output,), (tensor,), async_op,
        lambda: state.active().all_to_all_single(
            output, tensor, output_split_sizes, input_split_sizes, group, async_op
        ),
    )  # fmt: skip


def all_to_all(
    output_tensor_list: Any, input_tensor_list: Any, group: Any = None, async_op: bool = False
) -> Any:
    """Send ``input_tensor_list[i]`` to rank i; receive rank i's into ``output_tensor_list[i]``."""
    if _LOG.enabled and _LOG.wants(False, "all_to_all"):
        return _LOG.timed(
            "all_to_all",
            "all_to_all",
            None,
            lambda a: _all_to_all(output_tensor_list, input_tensor_list, group, a),
            async_op,
        )
    return _all_to_all(output_tensor_list, input_tensor_list, group, async_op)


def _all_to_all(outs: Any, ins: Any, group: Any, async_op: bool) -> Any:
    if _debug.enabled():
        w = get_world_size(group)
        counts = (_list_counts(ins, w), _list_counts(outs, w))
        _debug.check("all_to_all", group, [outs, ins], counts)
    return _in_order(
        "all_to_all", outs, ins, async_op,
        lambda: state.active().all_to_all(outs, ins, group, async_op),
    )  # fmt: skip


def gather(
    tensor: torch.Tensor,
    gather_list: Any = None,
    dst: int = 0,
    group: Any = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "gather",
    debug: str | None = None,
) -> Any:
    """Collect every rank's tensor into ``gather_list`` on ``dst`` (returns it there, else None)."""
    if _LOG.enabled and _LOG.wants(prof, log_name):
        return _LOG.timed(
            "gather",
            log_name,
            debug,
            lambda a: gather(tensor, gather_list, dst, group, a, log_name=BYPASS),
            async_op,
        )
    outs = gather_list if gather_list is not None and _is_me(dst) else ()
    _check(f"gather dst={dst}", group, [tensor])
    return _in_order(
        "gather", outs, (tensor,), async_op,
        lambda: state.active().gather(tensor, gather_list, dst, group, async_op),
    )  # fmt: skip


def scatter(
    tensor: torch.Tensor,
    scatter_list: Any = None,
    src: int = 0,
    group: Any = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "scatter",
    debug: str | None = None,
) -> Any:
    """Give rank i ``scatter_list[i]`` from ``src``, received into ``tensor``."""
    if _LOG.enabled and _LOG.wants(prof, log_name):
        return _LOG.timed(
            "scatter",
            log_name,
            debug,
            lambda a: scatter(tensor, scatter_list, src, group, a, log_name=BYPASS),
            async_op,
        )
    ins = scatter_list if scatter_list is not None and _is_me(src) else ()
    _check(f"scatter src={src}", group, [tensor])
    return _in_order(
        "scatter", (tensor,), ins, async_op,
        lambda: state.active().scatter(tensor, scatter_list, src, group, async_op),
    )  # fmt: skip


def barrier(
    group: Any = None,
    async_op: bool = False,
    device_ids: Any = None,
    prof: bool = False,
    log_name: str = "barrier",
    debug: str | None = None,
) -> Any:
    """Wait until every rank of the group reaches the barrier. ``device_ids`` is accepted for
    DeepSpeed's and torch's signature; overlap's barrier needs no device."""
    if _LOG.enabled and _LOG.wants(prof, log_name):
        return _LOG.timed(
            "barrier", log_name, debug, lambda a: barrier(group, a, log_name=BYPASS), async_op
        )
    _check("barrier", group, [])
    return state.active().barrier(group, async_op)


def monitored_barrier(
    group: Any = None,
    timeout: Any = None,
    wait_all_ranks: bool = False,
    prof: bool = False,
    log_name: str = "monitored_barrier",
    debug: str | None = None,
) -> None:
    """A barrier that raises CommError naming the rank(s) that did not arrive within
    ``timeout`` (seconds or timedelta; the job timeout by default), on every backend
    (:mod:`overlap.comm.monitored`)."""
    from overlap.comm.monitored import monitored_barrier as impl

    _maybe_timed(
        "monitored_barrier", prof, log_name, debug, group,
        lambda: impl(group, timeout, wait_all_ranks),
    )  # fmt: skip


# -------------------------------------------------------------------------- point to point
def send(
    tensor: torch.Tensor,
    dst: int,
    group: Any = None,
    tag: int = 0,
    prof: bool = False,
    log_name: str = "send",
    debug: str | None = None,
) -> None:
    """Send ``tensor`` to rank ``dst`` and wait until it is handed over."""
    if tag:
        check_tag(tag)
    if _claims.live:
        _claims.settle1("send", tensor, False)
    if _LOG.enabled and _LOG.wants(prof, log_name):
        _LOG.timed_call(
            "send",
            log_name,
            debug,
            lambda: state.active().send(tensor, dst, group, tag),
            tensor.numel() * tensor.element_size(),
            2,
        )
        return
    b = state._backend  # state.active() without its call (it raises when not initialised)
    (b if b is not None else state.active()).send(tensor, dst, group, tag)


def recv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: Any = None,
    tag: int = 0,
    prof: bool = False,
    log_name: str = "recv",
    debug: str | None = None,
) -> int:
    """Receive into ``tensor`` from ``src`` (any rank if None); returns the sender's rank."""
    if tag:
        check_tag(tag)
    if _claims.live:
        _claims.settle1("recv", tensor, True)
    if _LOG.enabled and _LOG.wants(prof, log_name):
        r0: int = _LOG.timed_call(
            "recv",
            log_name,
            debug,
            lambda: state.active().recv(tensor, src, group, tag),
            tensor.numel() * tensor.element_size(),
            2,
        )
        return r0
    b = state._backend  # state.active() without its call (it raises when not initialised)
    r: int = (b if b is not None else state.active()).recv(tensor, src, group, tag)
    return r


def isend(
    tensor: torch.Tensor,
    dst: int,
    group: Any = None,
    tag: int = 0,
    prof: bool = False,
    log_name: str = "isend",
    debug: str | None = None,
) -> Handle:
    """Start sending ``tensor`` to ``dst``; the Handle resolves to ``tensor``.

    Tags 20000-29999 are reserved (overlap's ring and naive allreduce, and
    monitored_barrier, use them)."""
    if tag:
        check_tag(tag)
    if _claims.live:
        _claims.settle1("isend", tensor, False)
    b = state._backend  # state.active() without its call (it raises when not initialised)
    h: Handle = (b if b is not None else state.active()).isend(tensor, dst, group, tag)
    if _LOG.enabled and _LOG.wants(prof, log_name):
        _LOG.time_handle("isend", _LOG.record_name(log_name, debug, depth=2), h)
    return h


def irecv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: Any = None,
    tag: int = 0,
    prof: bool = False,
    log_name: str = "irecv",
    debug: str | None = None,
) -> Handle:
    """Start receiving into ``tensor``; the Handle resolves to ``tensor``.

    To give up waiting, time out the *await* (``asyncio.wait_for``) or pass a timeout to
    ``wait``: the receive itself stays posted and keeps the tensor.
    """
    if tag:
        check_tag(tag)
    if _claims.live:
        _claims.settle1("irecv", tensor, True)
    b = state._backend  # state.active() without its call (it raises when not initialised)
    h: Handle = (b if b is not None else state.active()).irecv(tensor, src, group, tag)
    if _LOG.enabled and _LOG.wants(prof, log_name):
        _LOG.time_handle("irecv", _LOG.record_name(log_name, debug, depth=2), h)
    return h


def batch_isend_irecv(p2p_op_list: Sequence[Any]) -> list[Handle]:
    """Start several sends and receives at once; one Handle per op, in order.

    Takes :class:`P2POp` (``torch.distributed.P2POp`` works too).
    """
    for p in p2p_op_list:
        check_tag(getattr(p, "tag", 0) or 0)
    roles = [_p2p_roles(p) for p in p2p_op_list]
    check_batch_buffers(roles)
    if _claims.live:  # a collective in flight on a buffer of these waits first
        for w, r in roles:
            _claims.settle("batch_isend_irecv", w, r)
    handles: list[Handle] = state.active().batch_isend_irecv(p2p_op_list)
    return handles


def sendrecv(
    send_tensor: torch.Tensor,
    dst: int,
    recv_tensor: torch.Tensor,
    src: int | None,
    group: Any = None,
    tag: int = 0,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "sendrecv",
    debug: str | None = None,
) -> Any:
    """Send ``send_tensor`` to rank ``dst`` and receive ``recv_tensor`` from rank ``src``
    (any rank if None) in one call, as ``MPI_Sendrecv``: the receive is posted first, both
    with ``tag``. Returns ``recv_tensor`` once both are over, or with ``async_op=True`` one
    Handle that resolves to it (its ``source``: the sender's global rank).

    A send whose memory overlaps the receive's is sent from a copy taken at the call, so
    ``sendrecv(t, dst, t, src)`` exchanges ``t`` in place. Every argument is checked before
    anything is posted. The same tensors exchanged with the same peers again cost about
    what the backend's own pair costs (overlap.comm.exchange; docs/architecture.md)."""
    if tag:
        check_tag(tag)
    if _claims.live:
        _claims.settle("sendrecv", (recv_tensor,), (send_tensor,))
    b = state._backend  # state.active() without its call (it raises when not initialised)
    if b is None:
        b = state.active()
    if _LOG.enabled and _LOG.wants(prof, log_name):
        return _LOG.timed(
            "sendrecv",
            log_name,
            debug,
            lambda a: b.sendrecv(send_tensor, dst, recv_tensor, src, group, tag, a),
            async_op,
        )
    return b.sendrecv(send_tensor, dst, recv_tensor, src, group, tag, async_op)


def _p2p_roles(p: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """(written, read) of one P2POp (or torch's): a receive writes its tensor."""
    try:
        kind = p.kind if isinstance(p, P2POp) else getattr(p.op, "__name__", "")
        t = p.tensor
    except Exception:  # not a P2POp: the backend refuses it with the documented error
        return (), ()
    return ((t,), ()) if kind == "irecv" else ((), (t,))
