"""The torch.distributed backend: gloo for CPU tensors, NCCL for CUDA tensors.

Every op follows one path (:meth:`TorchBackend._launch`): validate, issue the torch op with
``async_op=True``, then either wait on the calling thread (blocking form) or hand the Work to
the waiter pool and return a :class:`~overlap.comm.handle.Handle` (async form). Post-processing
that torch does not do for us, the average on gloo and restoring a ``reduce``'s non-destination
tensors, runs before the op counts as complete, in both forms.

Blocking calls return what awaiting the handle would return (torch returns ``None``), except
``recv``, which returns the sender's rank like torch.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from overlap.comm import complex_product as _complex
from overlap.comm import debug as _debug
from overlap.comm import exchange as _exchange
from overlap.comm import gloo_fallback as _fallback
from overlap.comm import hooks as _hooks
from overlap.comm import inflight_writes as _inflight_writes
from overlap.comm import interruptible as _interruptible
from overlap.comm import ordered as _ordered
from overlap.comm import p2p_debug as _p2p_debug
from overlap.comm import quiesce as _quiesce
from overlap.comm import waiters as _waiters
from overlap.comm.aliasing import apart, apart_list
from overlap.comm.groups import (
    GroupInfo,
    NonMemberGroup,
    clear_cache,
    forget_group,
    is_live,
    resolve_group,
)
from overlap.comm.handle import EVENT_ENGINE, Handle
from overlap.comm.members import members_error
from overlap.comm.p2p import P2POp
from overlap.comm.reduce_op import ReduceOp, check_reducible, divides_first, parse_op
from overlap.comm.validate import (
    check_distinct,
    check_gathered_size,
    check_like,
    check_p2p_peer,
    check_peer,
    check_reduce_scatter_flat,
    check_reduce_scatter_list,
    check_splits,
    check_tensor,
    check_tensor_list,
    checked_root_list,
    nbytes_of,
    scratch_like,
    writable,
)
from overlap.comm.waiters import TorchOp
from overlap.dtypes import float8_dtypes, present
from overlap.errors import CommError

__all__ = ["TorchBackend"]

log = logging.getLogger(__name__)

_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.BAND: dist.ReduceOp.BAND,
    ReduceOp.BOR: dist.ReduceOp.BOR,
    ReduceOp.BXOR: dist.ReduceOp.BXOR,
}

PostFn = Callable[[], object]
_now = time.perf_counter_ns
_DRAIN_S = 0.005  # destroy_group's pause for gloo's workers (see there)
_Tensor = torch.Tensor
_strided = torch.strided
_weak = weakref.ref
# A send's or receive's memo (TorchBackend._last_p2p): (tensor ref, peer, group object, group
# info, dtype, group rank of the peer, its global rank)
_P2PMemo = tuple[Any, Any, Any, GroupInfo, torch.dtype, int, int]

# torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor in favour of the
# *_single names, which older releases (torch>=2.2 is supported) do not have.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# The options of the process-group calls made directly (_direct_first), made once: the process
# group copies them at issue. (ReduceScatterOptions per reduce op, in TorchBackend.)
_C10D = torch._C._distributed_c10d
_ALLGATHER_OPTS = _C10D.AllgatherOptions()
_ALLTOALL_OPTS = _C10D.AllToAllOptions()

# the op kinds whose direct process-group call this torch refused as missing (an older
# release's gloo): issued through torch's Python wrapper from then on
NO_DIRECT: set[str] = set()


def _as_real(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as its real pairs (a view); any other tensor as it is."""
    return torch.view_as_real(t) if t.is_complex() else t


def _any_source_buffer(t: torch.Tensor) -> torch.Tensor:
    """What a receive from any rank is posted into: ``t``, or for an empty ``t`` a 1-byte
    scratch buffer of its device.

    Why: gloo cannot match a message into an empty buffer from any source. Its
    ``recv_anysource`` fails its own check ("offset < this->size. 0 vs 0", in
    unbound_buffer.cc), so ``torch.distributed.recv(torch.empty(0), src=None)`` raises
    there, and the sender's side of the job is left waiting or sees a closed connection.
    The empty message the sender posts lands in the scratch byte, which is not touched, and
    the sender's rank is known as for any other receive (a receive from a given rank takes
    an empty buffer as it is)."""
    if t.nbytes:
        return t
    return torch.empty(1, dtype=torch.uint8, device=t.device)


def stacked(big: torch.Tensor, part: torch.Tensor, size: int) -> torch.Tensor:
    """``big`` (``size`` x ``part``'s elements, contiguous) as the concatenation of ``size``
    tensors shaped as ``part`` along dim 0, the one shape torch's gloo takes for the
    gathered output of all_gather_into_tensor and the input of reduce_scatter_tensor.

    Overlap's contract (NCCL's and MPI's) is the element count: the stacked form (``size``,
    then ``part``'s shape), which torch documents, and a flat tensor are accepted as well;
    gloo refused them ("invalid tensor size", "Check failed: outputShape[0] * worldSize ==
    inputShape[0]") where MPI and NCCL gave the result. A view costs no copy."""
    want = (size * part.shape[0], *part.shape[1:])
    return big if big.shape == want else big.view(want)


def _direct_first(kind: str, direct: Callable[[], Any], wrapper: Callable[[], Any]) -> Any:
    """``direct()``, the process group's own call, unless this torch refused it as missing
    (then, from the first refusal on, which comes at issue on every rank alike, before
    anything is sent: ``wrapper()``, torch's Python function, with its own fallbacks).

    Why: on 2 gloo ranks (a script, each way interleaved after a barrier, 600 rounds),
    torch's Python wrapper cost a 4-byte all_to_all_single 143-155 us against 112-113 called
    directly, all_gather_into_tensor 224-235 against 196, reduce_scatter_tensor 248
    against 213 (docs/architecture.md, "The tensor collectives straight to the process
    group"); all_reduce and broadcast have gone straight to it since lean-ops."""
    if kind not in NO_DIRECT:
        try:
            return direct()
        except RuntimeError as exc:
            said = str(exc)
            if not (_fallback.lacks(exc) or "not implemented" in said or "not supported" in said):
                raise
            NO_DIRECT.add(kind)
            log.info("%s: torch refused the direct call (%s); using its wrapper", kind, said)
    return wrapper()


# dtypes gloo refuses with a bare "Invalid scalar type" (measured, torch 2.13): refused here
# first, naming the tensor and the fix.
_GLOO_UNSUPPORTED = frozenset(present("int16", "uint16", "uint32", "uint64") + float8_dtypes())


def issue_failed(opname: str, rank: int, group: str, backend: str, exc: Exception) -> CommError:
    """The CommError for an op torch refused or failed to issue. Where this torch's backend
    lacks the op ("ProcessGroupGloo does not support reduce_scatter", torch 2.2.2; gloo's
    missing reduce_scatter and all_to_all are built from other ops instead, see
    overlap.comm.gloo_fallback), the message names the ways out. Every rank of the group
    gets the same refusal, before anything is sent, so the group stays in step."""
    msg = f"{opname} on rank {rank} (group {group}) failed: {exc}"
    if _fallback.lacks(exc):
        msg += (
            f". torch {torch.__version__}'s {backend} backend lacks this op: upgrade torch, "
            "use the MPI backend (init_distributed('mpi')), or an op it has (all_reduce, "
            "all_to_all_single)"
        )
    return CommError(msg)


class TorchBackend:
    """deepspeed.comm-style ops over an initialised torch.distributed default group."""

    def __init__(self, name: str, timeout: Any = None) -> None:
        self.name = name  # "gloo" or "nccl"
        self.device_type = "cuda" if name == "nccl" else "cpu"
        self._cpu = name != "nccl"
        self._native_avg = name == "nccl"
        self._bad_dtypes = _GLOO_UNSUPPORTED if name == "gloo" else frozenset()
        # The job's timeout (init_distributed(timeout=...)): every group made here gets it,
        # instead of torch's 30-minute default for new_group.
        self.timeout = timeout
        # Exit waits for ops still observed on backend threads (overlap/comm/quiesce.py).
        _quiesce.install(None if timeout is None else timeout.total_seconds())
        # (op spelling, dtype) -> (torch op, divide after?, AllreduceOptions, ordered keys?)
        self._reductions: dict[tuple[Any, torch.dtype], tuple[Any, bool, Any, Any]] = {}
        self._bcast_opts: dict[int, Any] = {}  # group rank of the root -> BroadcastOptions
        self._rs_opts: dict[Any, Any] = {}  # torch reduce op -> ReduceScatterOptions
        # The last isend and the last irecv that took the full path (gloo only), to post
        # again with no check repeated but those that can change: see _last_p2p
        self._last_send: _P2PMemo | None = None
        self._last_recv: _P2PMemo | None = None
        # sendrecv's last kept exchange (see sendrecv)
        self._last_sr: tuple[Any, ...] | None = None

    # ------------------------------------------------------------------ process & groups
    def get_rank(self, group: Any = None) -> int:
        return resolve_group(group).rank

    def get_world_size(self, group: Any = None) -> int:
        return resolve_group(group).size

    def get_global_rank(self, group: Any, group_rank: int) -> int:
        info = resolve_group(group)
        if not 0 <= group_rank < info.size:
            raise ValueError(
                f"group_rank={group_rank} is outside group {info.name} of size {info.size}"
            )
        return info.ranks[group_rank]

    def group_ranks(self, group: Any = None) -> list[int]:
        return list(resolve_group(group).ranks)

    def new_group(self, ranks: Sequence[int] | None = None, **kwargs: Any) -> Any:
        world = dist.get_world_size()
        if ranks is None:
            ranks = list(range(world))
        ranks = [int(r) for r in ranks]
        error = members_error(ranks, world)
        if error is not None:
            raise ValueError(error)
        # Every rank calls new_group with the same ranks, members or not (torch's rule),
        # unless use_local_synchronization=True: then only the members call.
        if kwargs.get("use_local_synchronization") and dist.get_rank() not in ranks:
            return NonMemberGroup(tuple(sorted(ranks)), dist.get_rank())
        if self.timeout is not None and kwargs.get("timeout") is None:
            kwargs["timeout"] = self.timeout
        pg = dist.new_group(ranks=sorted(ranks), **kwargs)
        if pg is dist.GroupMember.NON_GROUP_MEMBER:
            return NonMemberGroup(tuple(sorted(ranks)), dist.get_rank())
        return pg

    def destroy(self) -> None:
        clear_cache()
        self._last_send = self._last_recv = self._last_sr = None

    def destroy_group(self, group: Any) -> None:
        """Free one group from new_group (torch's destroy_process_group(group))."""
        if isinstance(group, NonMemberGroup) or group is dist.GroupMember.NON_GROUP_MEMBER:
            return  # nothing was made on this rank
        if group is dist.group.WORLD:
            raise ValueError(
                "destroy_process_group(group) frees a group from new_group; to leave the job "
                "call destroy_process_group() with no group"
            )
        from overlap.comm import debug, driver

        self._last_send = self._last_recv = self._last_sr = None  # no memo outlives its group
        if not is_live(group):
            # made in a job that destroy_process_group() has ended, which freed it then
            # (a scheduler made before it, removed after a new init_distributed())
            return
        # its multi-phase twin and its debug group too, if it has them
        for pg in (driver.forget(group), *debug.forget(group), group):
            if pg is not None:
                forget_group(pg)
                dist.destroy_process_group(pg)
        if self._cpu:
            # Let gloo's worker threads finish tearing down the group's last ops before the
            # caller drops it. On torch 2.2 a worker that frees an op's last reference to a
            # tensor takes the GIL, and freeing a ProcessGroupGloo holds the GIL while it
            # joins those workers: a deadlock, hit by a BucketScheduler refused right after
            # its start-up broadcast (py-spy: ~ProcessGroupGloo in pthread_mutex_lock, the
            # worker in gil_scoped_acquire under ~AsyncWork). Sleeping releases the GIL; a
            # group is freed rarely, so the few milliseconds cost nothing that matters.
            time.sleep(_DRAIN_S)

    # ------------------------------------------------------------------------- helpers
    def _t(self, t: Any, name: str, moves: bool = False) -> torch.Tensor:
        """The tensor to hand to torch: ``t`` itself, or a detached view of it when it
        requires grad (in-place collectives on a leaf that requires grad would fail half
        way). The common case is checked in a few attribute reads; anything unusual takes
        the full check, which raises with the problem and its fix.

        ``moves``: the op only moves the tensor's bytes, so a dtype gloo lacks is accepted
        (the op hands torch :meth:`_wire`'s byte view of it)."""
        if (
            isinstance(t, _Tensor)
            and (t.is_cpu if self._cpu else t.is_cuda)
            and t.layout is _strided
            and t.is_contiguous()
            and not t.is_conj()
            and not t.is_neg()
            and (moves or t.dtype not in self._bad_dtypes)
        ):
            return t.detach() if t.requires_grad else t
        checked = check_tensor(t, name, self.device_type, self.name)
        if not moves:
            self._check_dtype(checked, name)
        return checked.detach() if checked.requires_grad else checked

    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        """What an op that only moves bytes hands torch for checked tensor ``t``: ``t``, or,
        for a dtype gloo lacks (int16, the unsigned ints, float8), a uint8 view of it with
        its element's bytes as a new last dimension. Every other dimension is kept, so
        all_to_all_single's split sizes (rows of dim 0) and the gathered tensors' shapes
        mean what they meant. MPI and NCCL move these dtypes as they are; before, gloo
        refused them even for a broadcast or a send."""
        if t.dtype in self._bad_dtypes:
            return t.unsqueeze(-1).view(torch.uint8)
        return t

    def _check_dtype(self, t: torch.Tensor, name: str) -> None:
        if t.dtype in self._bad_dtypes:
            wider = "torch.int32" if "int" in str(t.dtype) else "torch.float16"
            raise TypeError(
                f"{name} is {t.dtype}, which gloo cannot reduce (it moves it as bytes in the "
                f"ops that only move data); convert it ({name}.to({wider})), or use the MPI "
                "backend"
            )

    def _ts(
        self, ts: Any, name: str, length: int | None = None, moves: bool = False
    ) -> list[torch.Tensor]:
        out = check_tensor_list(ts, name, self.device_type, self.name, length)
        if self._bad_dtypes and not moves:
            for i, t in enumerate(out):
                self._check_dtype(t, f"{name}[{i}]")
        return out

    def _launch(
        self,
        opname: str,
        info: GroupInfo,
        issue: Callable[[], Any],
        result: Any,
        nbytes: int,
        async_op: bool,
        post: PostFn | None = None,
        keep: Any = None,
        future: bool = True,
    ) -> Any:
        """Issue the op; block on it here, or return its Handle.

        ``future``: the op's gloo Work has a future (false for p2p and reduce_scatter), so
        an awaited Handle can complete from its callback (overlap.comm.waiters.TorchOp).
        """
        if not async_op:
            obs = _hooks.observer
            t0 = _now() if obs is not None else 0
            try:
                work = issue()
                if work is not None:
                    if future and self._cpu:  # polled first, as an awaited op is
                        _waiters.poll_first(work, nbytes)
                    _interruptible.wait(work, future and self._cpu)  # Ctrl-C lands in it
            except (ValueError, TypeError):
                raise
            except Exception as exc:
                raise issue_failed(opname, info.global_rank, info.name, self.name, exc) from exc
            if post is not None:
                post()
            if obs is not None:
                obs(opname, t0, _now(), nbytes, info.name, self.name, info.size)
            return result
        # positional, the engine given: every async op and every p2p post passes here
        handle = Handle(opname, result, nbytes, info.name, self.name, keep, EVENT_ENGINE, info.size)
        try:
            work = issue()
        except (ValueError, TypeError):
            raise
        except Exception as exc:
            raise issue_failed(opname, info.global_rank, info.name, self.name, exc) from exc
        if work is None:  # torch skipped the op (e.g. empty tensor on some versions)
            if post is not None:
                post()
            handle._finish(None)
            return handle
        if _debug._enabled and self._cpu and opname in _inflight_writes.RAW_ON_GLOO:
            # its tensors must not be written until it completes
            post = _inflight_writes.guard(opname, info.global_rank, result, post)
        stream = None if self._cpu else torch.cuda.current_stream()  # _issue_stream's
        handle._engine = TorchOp(work, post, info.global_rank, stream, future)
        return handle

    def _issue_stream(self) -> Any:
        """NCCL: the CUDA stream current at issue, which a handle's wait orders the result on
        (overlap.comm.waiters); None on gloo."""
        return None if self._cpu else torch.cuda.current_stream()

    def _reduction(self, op: Any, dtype: torch.dtype) -> tuple[Any, bool, Any, ReduceOp | None]:
        """(torch op, divide after?, AllreduceOptions, the op when it reduces ordered keys
        (:meth:`_keyed`) else None), cached per (op spelling, dtype): a spelling is validated
        once, and the options object is made once."""
        try:
            key = (op, dtype)
            hit = self._reductions.get(key)
        except TypeError:  # an unhashable op spelling: resolve it every time
            key, hit = None, None
        if hit is None:
            rop, top, divide = self._reduce_args(op, dtype)
            opts = dist.AllreduceOptions()
            opts.reduceOp = top
            hit = (top, divide, opts, rop if self._keyed(rop, dtype) else None)
            if key is not None:
                self._reductions[key] = hit
        return hit

    def _keyed(self, rop: ReduceOp, dtype: torch.dtype) -> bool:
        """Whether ``rop`` on ``dtype`` reduces ordered keys (overlap.comm.ordered): a max or
        min of floats on the CPU, where gloo's own drops a NaN unless rank 0 holds it."""
        return self._cpu and _ordered.keyed(rop, dtype)

    def _reduce_args(self, op: Any, dtype: torch.dtype) -> tuple[ReduceOp, Any, bool]:
        rop = parse_op(op)
        check_reducible(rop, dtype)
        if rop is ReduceOp.AVG:
            if self._native_avg:
                return rop, dist.ReduceOp.AVG, False
            return rop, dist.ReduceOp.SUM, True
        return rop, _TORCH_OPS[rop], False

    # --------------------------------------------------------------------- collectives
    def all_reduce(
        self, tensor: torch.Tensor, op: Any = "sum", group: Any = None, async_op: bool = False
    ) -> Any:
        t = self._t(tensor, "tensor")
        top, divide, opts, keyed = self._reduction(op, t.dtype)
        info = resolve_group(group)
        if keyed is not None:
            keys = _ordered.to_keys(t, keyed)
            return self._launch(
                "all_reduce", info, partial(info.pg.allreduce, [keys], opts), tensor, t.nbytes,
                async_op, partial(_ordered.from_keys, keys, t), keep=keys,
            )  # fmt: skip
        post: PostFn | None = None
        if divide:
            if divides_first(ReduceOp.AVG, t.dtype):  # before the sum, as NCCL's
                t.div_(info.size)
            else:
                post = partial(t.div_, info.size)
        if t.is_complex():  # torch's wrapper reduces complex tensors as real pairs
            if top == dist.ReduceOp.PRODUCT:  # which is not a product of complex numbers
                return self._complex_product("all_reduce", t, tensor, info, async_op, True)
            issue: Callable[[], Any] = partial(
                dist.all_reduce, t, op=top, group=info.pg, async_op=True
            )
        else:  # straight to the process group: torch's Python wrapper costs ~17 us a call
            issue = partial(info.pg.allreduce, [t], opts)
        return self._launch("all_reduce", info, issue, tensor, t.nbytes, async_op, post)

    def _complex_product(
        self,
        opname: str,
        t: torch.Tensor,
        result: Any,
        info: GroupInfo,
        async_op: bool,
        write: bool,
    ) -> Any:
        """all_reduce's or reduce's product of complex ``t``: gathered, then multiplied in
        rank order into ``t`` where ``write`` (overlap.comm.complex_product says why)."""
        issue, pieces = _complex.gather_issue(t, info.pg, info.size, _all_gather_single)
        post = partial(_complex.fold_into, pieces, t) if write else None
        return self._launch(opname, info, issue, result, nbytes_of(t), async_op, post, keep=pieces)

    def broadcast(
        self, tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False
    ) -> Any:
        t = self._t(tensor, "tensor", moves=True)
        info = resolve_group(group)
        root = self._group_rank(src, "src", info)
        if t.is_complex():
            issue: Callable[[], Any] = partial(
                dist.broadcast, t, src=src, group=info.pg, async_op=True
            )
        else:
            issue = partial(info.pg.broadcast, [self._wire(t)], self._broadcast_options(root))
        return self._launch("broadcast", info, issue, tensor, t.nbytes, async_op)

    def _broadcast_options(self, root: int) -> Any:
        """The BroadcastOptions for group rank ``root``, made once per root, as
        all_reduce's options are (:meth:`_reduction`): making one and setting its fields
        cost 0.95 us a call, single process. The process group copies them at issue."""
        opts = self._bcast_opts.get(root)
        if opts is None:
            opts = dist.BroadcastOptions()
            opts.rootRank = root
            opts.rootTensor = 0
            self._bcast_opts[root] = opts
        return opts

    def reduce(
        self,
        tensor: torch.Tensor,
        dst: int,
        op: Any = "sum",
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        t = self._t(tensor, "tensor")
        rop, top, divide = self._reduce_args(op, t.dtype)
        info = resolve_group(group)
        check_peer(dst, "dst", info.ranks, info.name)
        if rop is ReduceOp.PRODUCT and t.is_complex():
            mine = info.global_rank == dst
            return self._complex_product("reduce", t, tensor, info, async_op, mine)
        post: PostFn | None = None
        if self._keyed(rop, t.dtype):
            # the keys are scratch: the tensor changes only on dst, from them
            keys = _ordered.to_keys(t, rop)
            if info.global_rank == dst:
                post = partial(_ordered.from_keys, keys, t)
            return self._launch(
                "reduce", info,
                lambda: dist.reduce(keys, dst=dst, op=top, group=info.pg, async_op=True),
                tensor, nbytes_of(t), async_op, post, keep=keys,
            )  # fmt: skip
        first = divide and divides_first(rop, t.dtype)
        if info.global_rank == dst:
            if divide and not first:
                post = partial(t.div_, info.size)
        else:
            # gloo leaves partial sums in non-destination tensors; deepspeed.comm documents
            # them as unchanged, so keep a copy and put it back once the op is done.
            backup = t.clone()

            post = partial(t.copy_, backup)
        if first:  # float16: each rank's share, summed (after the backup above)
            t.div_(info.size)

        return self._launch(
            "reduce",
            info,
            lambda: dist.reduce(t, dst=dst, op=top, group=info.pg, async_op=True),
            tensor,
            nbytes_of(t),
            async_op,
            post,
        )

    def all_gather(
        self, tensor_list: Any, tensor: Any = None, group: Any = None, async_op: bool = False
    ) -> Any:
        if isinstance(tensor_list, torch.Tensor) and tensor is None:
            # Convenience form: all_gather(tensor) -> list of every rank's tensor.
            t = self._t(tensor_list, "tensor", moves=True)
            info = resolve_group(group)
            outs = [torch.empty_like(t) for _ in range(info.size)]
        else:
            t = self._t(tensor, "tensor", moves=True)
            info = resolve_group(group)
            outs = self._ts(tensor_list, "tensor_list", info.size, moves=True)
            check_like(outs, t, "tensor_list", "tensor")
            check_distinct(outs, "tensor_list")
        into = [self._wire(o) for o in writable(outs)]
        return self._launch(
            "all_gather",
            info,
            lambda: dist.all_gather(into, self._wire(t), group=info.pg, async_op=True),
            outs,
            nbytes_of(t),
            async_op,
        )

    def all_gather_into_tensor(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        out = self._t(output_tensor, "output_tensor", moves=True)
        inp = self._t(input_tensor, "tensor", moves=True)
        info = resolve_group(group)
        check_gathered_size(out, inp, info.size)
        out = self._wire(stacked(out, inp, info.size))
        inp = self._wire(apart(inp, out, info.rank * nbytes_of(inp)))
        wrapper = partial(_all_gather_single, out, inp, group=info.pg, async_op=True)
        issue: Callable[[], Any] = wrapper
        if not (out.is_complex() or inp.is_complex()):  # torch's wrapper views them as real
            direct = partial(info.pg._allgather_base, out, inp, _ALLGATHER_OPTS)
            issue = partial(_direct_first, "all_gather_into_tensor", direct, wrapper)
        return self._launch(
            "all_gather_into_tensor", info, issue, output_tensor, nbytes_of(inp), async_op
        )

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: Any,
        op: Any = "sum",
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        out = self._t(output, "output")
        rop, top, divide = self._reduce_args(op, out.dtype)
        info = resolve_group(group)
        first = divide and divides_first(rop, out.dtype)
        post: PostFn | None = (lambda: out.div_(info.size)) if divide and not first else None
        data: Any  # what the op reads: one flat tensor, or the list of chunks
        if isinstance(input, torch.Tensor):
            inp = self._t(input, "input_list")
            check_reduce_scatter_flat(out, inp, info.size)
            data = apart(stacked(inp, out, info.size), out, -info.rank * nbytes_of(out))
            kind, torch_op = "reduce_scatter_flat", _reduce_scatter_single
        else:
            data = self._ts(input, "input_list", info.size)
            check_reduce_scatter_list(out, data)
            # the contract is each chunk's element count (as on MPI); gloo takes only
            # chunks shaped as the output ("Check failed: outputs[0].sizes() == ...")
            data = apart_list(
                [x if x.shape == out.shape else x.reshape(out.shape) for x in data], [out]
            )
            kind, torch_op = "reduce_scatter", dist.reduce_scatter
        if rop is ReduceOp.PRODUCT and out.is_complex():
            chunks = data if isinstance(data, torch.Tensor) else torch.stack(data)
            issue_rs, pieces = _complex.scatter_issue(chunks, info.pg, info.size)
            return self._launch(
                "reduce_scatter", info, issue_rs, output, nbytes_of(chunks), async_op,
                partial(_complex.fold_into, pieces, out), keep=pieces, future=False,
            )  # fmt: skip
        if first:  # float16: the shares are summed, in scratch (the input stays the user's)
            data = (
                data / info.size
                if isinstance(data, torch.Tensor)
                else [x / info.size for x in data]
            )
        nbytes = nbytes_of(data)
        if self._keyed(rop, out.dtype):  # reduce ordered keys into scratch, then out
            if isinstance(data, torch.Tensor):
                data = _ordered.to_keys(data, rop)
            else:
                data = [_ordered.to_keys(x, rop) for x in data]
            keys = torch.empty(out.shape, dtype=_ordered.key_dtype(out.dtype))
            post = partial(_ordered.from_keys, keys, out)
            out = keys
        issue: Callable[[], Any] = partial(
            torch_op, out, data, op=top, group=info.pg, async_op=True
        )
        if kind == "reduce_scatter_flat" and not out.is_complex():
            direct = partial(info.pg._reduce_scatter_base, out, data, self._rs_options(top))
            issue = partial(_direct_first, kind, direct, issue)
        return self._native_or_fallback(
            kind,
            lambda: self._launch(
                "reduce_scatter",
                info,
                issue,
                output,
                nbytes,
                async_op,
                post,
                keep=data,
                future=False,
            ),
            lambda: self._reduce_scatter_fallback(out, data, top, info, async_op, post),
        )

    def _rs_options(self, top: Any) -> Any:
        """The ReduceScatterOptions for torch reduce op ``top``, made once per op."""
        opts = self._rs_opts.get(top)
        if opts is None:
            opts = _C10D.ReduceScatterOptions()
            opts.reduceOp = top
            self._rs_opts[top] = opts
        return opts

    def _reduce_scatter_fallback(
        self,
        out: torch.Tensor,
        inp: Any,
        top: Any,
        info: GroupInfo,
        async_op: bool,
        post: PostFn | None,
    ) -> Any:
        """reduce_scatter where this torch's gloo lacks it (overlap.comm.gloo_fallback)."""
        issue, copy_out, keep = _fallback.reduce_scatter(out, inp, top, info.pg, info.rank)
        then = copy_out if post is None else (lambda: (copy_out(), post()))
        nbytes = nbytes_of(inp)
        return self._launch("reduce_scatter", info, issue, out, nbytes, async_op, then, keep=keep)

    def _native_or_fallback(
        self, kind: str, native: Callable[[], Any], fallback: Callable[[], Any]
    ) -> Any:
        """``native()``, unless this torch's gloo lacks the op ``kind``: then (from the first
        refusal on, which comes at issue, before anything is sent, on every rank alike)
        ``fallback()``, which builds it from ops gloo has (overlap.comm.gloo_fallback)."""
        if self.name != "gloo":
            return native()
        if kind not in _fallback.LACKING:
            try:
                return native()
            except CommError as exc:
                if not _fallback.lacks(exc.__cause__):
                    raise
            _fallback.note_lacking(kind)
        return fallback()

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int] | None = None,
        input_split_sizes: Sequence[int] | None = None,
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        out = self._t(output, "output", moves=True)
        inp = self._t(input, "tensor", moves=True)
        info = resolve_group(group)
        # as plain lists: torch takes no tensor or array of split sizes
        ins = check_splits(inp, input_split_sizes, "input", info.size)
        outs = check_splits(out, output_split_sizes, "output", info.size)
        in_sp = None if input_split_sizes is None else ins
        out_sp = None if output_split_sizes is None else outs
        out, inp = self._wire(out), self._wire(apart(inp, out))
        wrapper = partial(
            dist.all_to_all_single, out, inp, out_sp, in_sp, group=info.pg, async_op=True
        )
        issue: Callable[[], Any] = wrapper
        if not (out.is_complex() or inp.is_complex()):  # torch's wrapper views them as real
            sizes = ([] if out_sp is None else out_sp), ([] if in_sp is None else in_sp)
            direct = partial(info.pg.alltoall_base, out, inp, *sizes, _ALLTOALL_OPTS)
            issue = partial(_direct_first, "all_to_all_single", direct, wrapper)
        return self._launch(
            "all_to_all_single", info, issue, output, nbytes_of(inp), async_op, keep=inp
        )

    def all_to_all(
        self,
        output_tensor_list: Any,
        input_tensor_list: Any,
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        info = resolve_group(group)
        outs = self._ts(output_tensor_list, "output_tensor_list", info.size, moves=True)
        check_distinct(outs, "output_tensor_list")
        ins = self._ts(input_tensor_list, "input_tensor_list", info.size, moves=True)
        ins = apart_list(ins, outs)
        nbytes = nbytes_of(ins)
        into = writable(outs)  # outs stays the result: the caller's own list

        def fallback() -> Any:
            issue, copy_out, keep = _fallback.all_to_all(into, ins, info.pg)
            return self._launch("all_to_all", info, issue, outs, nbytes, async_op, copy_out, keep)

        if self.name == "gloo":
            # Always the bytes' all_to_all_single on gloo: gloo's own takes lists whose
            # tensors share one shape ("invalid tensor size at index 1"), so an uneven
            # exchange (MoE tokens) failed on gloo where MPI and NCCL ran it; and the choice
            # cannot depend on this rank's sizes (one rank's lists may be even while another's
            # are not: two different collectives). Its cost: docs/benchmarks.md.
            return fallback()
        return self._launch(
            "all_to_all",
            info,
            lambda: dist.all_to_all(into, ins, group=info.pg, async_op=True),
            outs,
            nbytes,
            async_op,
            keep=ins,
        )

    def gather(
        self,
        tensor: torch.Tensor,
        gather_list: Any = None,
        dst: int = 0,
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        t = self._t(tensor, "tensor", moves=True)
        info = resolve_group(group)
        check_peer(dst, "dst", info.ranks, info.name)
        # gloo's gather has no complex type ("Invalid scalar type") and torch's wrapper,
        # unlike all_gather's, does not view complex tensors as real pairs: do it here
        real = self._wire(_as_real(t))
        outs: list[torch.Tensor] | None = None
        if dist.get_rank() == dst:
            outs = checked_root_list(
                gather_list,
                "gather_list",
                "gather",
                "destination",
                dst,
                info.size,
                t,
                partial(self._ts, moves=True),
                lambda: dist.gather(real, scratch_like(real, info.size), dst=dst, group=info.pg),
            )
        into = None if outs is None else [self._wire(_as_real(o)) for o in writable(outs)]
        return self._launch(
            "gather",
            info,
            lambda: dist.gather(real, into, dst=dst, group=info.pg, async_op=True),
            outs,
            nbytes_of(t),
            async_op,
        )

    def scatter(
        self,
        tensor: torch.Tensor,
        scatter_list: Any = None,
        src: int = 0,
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        t = self._t(tensor, "tensor", moves=True)
        info = resolve_group(group)
        check_peer(src, "src", info.ranks, info.name)
        ins: list[torch.Tensor] | None = None
        if dist.get_rank() == src:
            ins = checked_root_list(
                scatter_list,
                "scatter_list",
                "scatter",
                "source",
                src,
                info.size,
                t,
                partial(self._ts, moves=True),
                lambda: dist.scatter(
                    self._wire(torch.empty_like(t)),
                    [self._wire(x) for x in scratch_like(t, info.size)],
                    src=src,
                    group=info.pg,
                ),
            )
            ins = apart_list(ins, [t])  # gloo lands the source's own part before sending
        wire = self._wire(t)
        parts = None if ins is None else [self._wire(x) for x in ins]
        return self._launch(
            "scatter",
            info,
            lambda: dist.scatter(wire, parts, src=src, group=info.pg, async_op=True),
            tensor,
            nbytes_of(ins),
            async_op,
            keep=ins,
        )

    def barrier(self, group: Any = None, async_op: bool = False) -> Any:
        info = resolve_group(group)
        return self._launch(
            "barrier",
            info,
            lambda: dist.barrier(group=info.pg, async_op=True),
            None,
            0,
            async_op,
        )

    # -------------------------------------------------------------------- point to point
    @staticmethod
    def _group_rank(peer: Any, what: str, info: GroupInfo) -> int:
        """The group rank of global rank ``peer``; raises (check_peer) unless it is a member."""
        i = info.index.get(peer) if type(peer) is int else None
        if i is None:
            check_peer(peer, what, info.ranks, info.name)  # raises unless a member
            i = info.index[int(peer)]  # an int subclass (an IntEnum) that is a member
        return i

    def _p2p_check(self, peer: int, what: str, info: GroupInfo) -> int:
        """The group rank of ``peer``; raises unless it is another member of the group."""
        if peer == info.global_rank:
            return check_p2p_peer(peer, what, info.ranks, info.name, info.global_rank)
        return self._group_rank(peer, what, info)

    def _last_p2p(self, m: _P2PMemo | None, tensor: Any, peer: Any, group: Any) -> bool:
        """Whether a send or receive is ``m``, the last one of its kind that took the full
        path, again: the same tensor object (a weak reference), peer and group objects, and
        what can change on one tensor object in place and matters to the post the same (the
        dtype: gloo refuses some, a complex one is sent as real; the contiguity). The tensor
        object itself is posted, so its address and size are whatever they are now, and the
        tag is the call's own. ``peer is`` holds for the small ints every rank of a run is;
        any other object misses and takes the full path. A group's memo is dropped when it
        is destroyed, the backend's when the job ends. Debug mode frames its messages: never
        taken then.

        Why: on 2 gloo ranks right after a barrier, the full path's checks, group lookup,
        peer check and post closure made a 4-byte ``irecv`` take 31.8-35.7 us against
        torch's own ``dist.irecv``'s 21.5-25.0 (``pg.recv`` alone 14.2), and each
        microsecond before a post is waited for again by the peer (docs/architecture.md,
        "gloo's point-to-point calls seen before")."""
        return (
            m is not None
            and m[0]() is tensor
            and peer is m[1]
            and group is m[2]
            and tensor.dtype is m[4]
            and tensor.is_contiguous()
            and not _debug._enabled
        )

    def _memo(
        self, t: torch.Tensor, tensor: Any, peer: Any, group: Any, info: GroupInfo, p: int
    ) -> _P2PMemo | None:
        """The memo of a send or receive the full path just posted: only a plain gloo call
        (the checked tensor is the caller's own and real, the peer an int)."""
        if not (
            self._cpu
            and t is tensor
            and type(peer) is int
            and not t.is_complex()
            and t.dtype not in self._bad_dtypes
            and not _debug._enabled
        ):
            return None
        return (_weak(t), peer, group, info, t.dtype, p, int(info.ranks[p]))

    def _post_p2p(self, opname: str, tensor: torch.Tensor, m: _P2PMemo, tag: int) -> Handle:
        """Post a send or receive of ``m`` again (``tensor`` passed :meth:`_last_p2p`),
        through :meth:`_launch` as the full path does."""
        info: GroupInfo = m[3]
        post = info.pg.send if opname == "isend" else info.pg.recv
        issue = partial(post, [tensor], m[5], tag)
        h: Handle = self._launch(opname, info, issue, tensor, tensor.nbytes, True, future=False)
        if opname == "irecv":
            h._source = m[6]
        return h

    def isend(self, tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> Handle:
        m = self._last_send
        if self._last_p2p(m, tensor, dst, group):
            assert m is not None
            return self._post_p2p("isend", tensor, m, tag)
        t = self._t(tensor, "tensor", moves=True)
        info = resolve_group(group)
        peer = self._p2p_check(dst, "dst", info)
        if _debug._enabled and _p2p_debug.is_framed(t):
            return _p2p_debug.isend(
                lambda x, tg: self._isend(x, x, info, peer, tg),
                t,
                tag,
                _p2p_debug.new_outer("isend", tensor, info.name, self.name, info.size),
                info.global_rank,
            )
        h = self._isend(t, tensor, info, peer, tag)
        self._last_send = self._memo(t, tensor, dst, group, info, peer)
        return h

    def _isend(self, t: torch.Tensor, result: Any, info: GroupInfo, peer: int, tag: int) -> Handle:
        """Issue the send of checked tensor ``t`` to group rank ``peer``."""
        t = self._wire(_as_real(t))
        h: Handle = self._launch(
            "isend", info, partial(info.pg.send, [t], peer, tag), result, t.nbytes, True,
            future=False,
        )  # fmt: skip
        return h

    def irecv(
        self, tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0
    ) -> Handle:
        m = self._last_recv
        if self._last_p2p(m, tensor, src, group):
            assert m is not None
            return self._post_p2p("irecv", tensor, m, tag)
        return self._checked_irecv(tensor, src, group, tag, None)

    def _checked_irecv(
        self, tensor: torch.Tensor, src: int | None, group: Any, tag: int, sender: list[int] | None
    ) -> Handle:
        """irecv, through debug mode's headers when it is on (overlap.comm.p2p_debug);
        ``sender`` (debug mode) gets the sending rank."""
        t = self._t(tensor, "tensor", moves=True)
        info = resolve_group(group)
        peer = None if src is None else self._p2p_check(src, "src", info)
        if _debug._enabled and _p2p_debug.is_framed(t):
            got: list[int] = [] if sender is None else sender
            h = _p2p_debug.irecv(
                lambda x, s, tg: self._irecv(
                    x, x, None if s is None else self._p2p_check(s, "src", info), info, tg
                ),
                t,
                src,
                tag,
                _p2p_debug.new_outer("irecv", tensor, info.name, self.name, info.size),
                info.global_rank,
                got,
            )
            h._source = lambda: got[0] if got else None
            return h
        h = self._irecv(t, tensor, peer, info, tag)
        if sender is None and peer is not None:  # irecv's, from a given rank: kept
            self._last_recv = self._memo(t, tensor, src, group, info, peer)
        return h

    def _irecv(
        self, t: torch.Tensor, result: Any, peer: int | None, info: GroupInfo, tag: int
    ) -> Handle:
        """Post the receive of checked tensor ``t`` from group rank ``peer`` (None: any)."""
        t = self._wire(_as_real(t))
        if peer is not None:
            issue = partial(info.pg.recv, [t], peer, tag)
            h: Handle = self._launch("irecv", info, issue, result, t.nbytes, True, future=False)
            h._source = int(info.ranks[peer])
            return h
        works: list[Any] = []
        into = _any_source_buffer(t)

        def issue_any() -> Any:
            works.append(info.pg.recv_anysource([into], tag))
            return works[0]

        h = self._launch("irecv", info, issue_any, result, t.nbytes, True, future=False)
        # read once the receive completed (Handle.source); the Work is kept for it
        h._source = lambda: int(info.ranks[works[0]._source_rank()])
        return h

    def send(self, tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> None:
        """isend's last call again (:meth:`_last_p2p`, no tracer) is posted to the process
        group and waited here, with no Handle (see :meth:`recv`). Anything else:
        ``isend(...).wait()``."""
        m = self._last_send
        if self._last_p2p(m, tensor, dst, group) and _hooks.observer is None:
            assert m is not None
            self._wait_kept("send", m, tensor, tag)
            return
        self.isend(tensor, dst, group, tag).wait()

    def _wait_kept(self, opname: str, m: _P2PMemo, tensor: torch.Tensor, tag: int) -> None:
        """Post a kept send or receive ``m`` of ``tensor`` (it passed :meth:`_last_p2p`) to
        the process group and wait on it here."""
        info = m[3]
        post = info.pg.send if opname == "send" else info.pg.recv
        try:
            post([tensor], m[5], tag).wait()
        except Exception as exc:
            raise issue_failed(opname, info.global_rank, info.name, self.name, exc) from exc

    def recv(
        self, tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0
    ) -> int:
        """irecv's last call from a given rank again (no tracer) is posted to the process
        group and waited here, with no Handle; a receive from a given rank that takes the
        full path is kept for it, as irecv's is. The MPI backend's ``send`` and ``recv``
        gained most from this (a blocking ping-pong 3.7x -> 1.7x mpi4py's); gloo's was at
        torch's speed already (0.97-0.98x before, 0.95-1.00x after: scripts/pingpong.py)."""
        m = self._last_recv
        if self._last_p2p(m, tensor, src, group) and _hooks.observer is None:
            assert m is not None
            self._wait_kept("recv", m, tensor, tag)
            return m[6]
        if _debug._enabled and _p2p_debug.is_framed(tensor):
            sender: list[int] = []
            self._checked_irecv(tensor, src, group, tag, sender).wait()
            return sender[0]
        t = self._t(tensor, "tensor", moves=True)
        info = resolve_group(group)
        peer = None if src is None else self._p2p_check(src, "src", info)
        try:
            into = self._wire(t) if src is not None else _any_source_buffer(self._wire(t))
            work: Any = dist.irecv(into, src=src, group=info.pg, tag=tag)
            work.wait()
        except Exception as exc:
            raise CommError(f"recv on rank {info.global_rank} failed: {exc}") from exc
        if src is not None:
            assert peer is not None
            self._last_recv = self._memo(t, tensor, src, group, info, peer)
            return src
        return int(info.ranks[work._source_rank()]) if hasattr(work, "_source_rank") else -1

    def sendrecv(
        self,
        send: Any,
        dst: Any,
        recv: Any,
        src: Any,
        group: Any = None,
        tag: int = 0,
        async_op: bool = False,
    ) -> Any:
        """overlap.comm.sendrecv: the last exchange by its two tensor objects (weak
        references), peers and group objects, with the same dtypes, addresses, byte counts
        and contiguity, posts both to the process group again (``pg.recv``, ``pg.send``)
        and waits on both here, or returns one Handle whose engine waits both on one
        waiter thread (overlap.comm.exchange.PairWork). Anything else takes
        :meth:`_sendrecv`."""
        m = self._last_sr
        if (
            m is not None
            and m[0]() is send
            and m[1]() is recv
            and dst is m[2]
            and src is m[3]
            and group is m[4]
            and send.dtype is m[5]
            and recv.dtype is m[6]
            and send.data_ptr() == m[7]
            and recv.data_ptr() == m[8]
            and send.nbytes == m[9]
            and recv.nbytes == m[10]
            and send.is_contiguous()
            and recv.is_contiguous()
            and _hooks.observer is None
            and not _debug._enabled
        ):
            return self._post_pair(m[11], m[12], m[13], m[14], send, recv, tag, async_op)
        return self._sendrecv(send, dst, recv, src, group, tag, async_op)

    def _sendrecv(
        self, send: Any, dst: Any, recv: Any, src: Any, group: Any, tag: int, async_op: bool
    ) -> Any:
        """sendrecv's full path: every check before anything is posted; a plain gloo
        exchange (given peers, memory apart, dtypes gloo moves as they are, no tracer or
        debug mode) is kept for :meth:`sendrecv`; anything else is this backend's own irecv
        and isend (overlap.comm.exchange.composed)."""
        s = self._t(send, "send_tensor", moves=True)
        r = self._t(recv, "recv_tensor", moves=True)
        info = resolve_group(group)
        pd = self._p2p_check(dst, "dst", info)
        ps = None if src is None else self._p2p_check(src, "src", info)
        s = apart(s, r)  # an in-place exchange sends a copy
        if (
            self._cpu
            and s is send
            and r is recv
            and ps is not None
            and type(dst) is int
            and type(src) is int
            and s.nbytes
            and r.nbytes
            and not (s.is_complex() or r.is_complex())
            and s.dtype not in self._bad_dtypes
            and r.dtype not in self._bad_dtypes
            and _hooks.observer is None
            and not _debug._enabled
        ):
            gsrc = int(info.ranks[ps])
            self._last_sr = (
                _weak(s), _weak(r), dst, src, group, s.dtype, r.dtype, s.data_ptr(),
                r.data_ptr(), s.nbytes, r.nbytes, info, pd, ps, gsrc,
            )  # fmt: skip
            return self._post_pair(info, pd, ps, gsrc, s, r, tag, async_op)
        return _exchange.composed(self, s, dst, recv, src, group, tag, async_op)

    def _post_pair(
        self,
        info: GroupInfo,
        pd: int,
        ps: int,
        gsrc: int,
        send: torch.Tensor,
        recv: torch.Tensor,
        tag: int,
        async_op: bool,
    ) -> Any:
        """Post a kept exchange (group ranks ``pd``, ``ps``): the receive, then the send."""
        pg = info.pg
        try:
            rw = pg.recv([recv], ps, tag)
            sw = pg.send([send], pd, tag)
            if not async_op:
                rw.wait()
                sw.wait()
                return recv
        except Exception as exc:
            raise issue_failed("sendrecv", info.global_rank, info.name, self.name, exc) from exc
        h = Handle(
            "sendrecv", recv, recv.nbytes, info.name, self.name, (send, recv), EVENT_ENGINE,
            info.size,
        )  # fmt: skip
        h._engine = TorchOp(_exchange.PairWork(rw, sw), None, info.global_rank)
        h._source = gsrc
        return h

    def batch_isend_irecv(self, p2p_op_list: Sequence[Any]) -> list[Handle]:
        if not p2p_op_list:
            raise ValueError("batch_isend_irecv needs at least one P2POp")
        torch_ops = []
        for i, p in enumerate(p2p_op_list):
            if isinstance(p, dist.P2POp):
                kind = getattr(p.op, "__name__", "")
                p = P2POp(kind, p.tensor, p.peer, p.group, p.tag)
            if not isinstance(p, P2POp):
                raise TypeError(f"p2p_op_list[{i}] must be a P2POp, got {type(p).__name__}")
            kind = p.kind
            t = self._t(p.tensor, f"p2p_op_list[{i}].tensor", moves=True)
            info = resolve_group(p.group)
            self._p2p_check(p.peer, f"p2p_op_list[{i}].peer", info)
            fn = dist.isend if kind == "isend" else dist.irecv
            op = dist.P2POp(fn, self._wire(t), p.peer, info.pg, p.tag)
            torch_ops.append((kind, p.tensor, t.nbytes, info, op))
        if _debug._enabled and all(_p2p_debug.is_framed(op.tensor) for *_, op in torch_ops):
            # gloo runs a batch as its sends and receives one by one anyway
            return [
                self.isend(tensor, op.peer, op.group, op.tag)
                if kind == "isend"
                else self.irecv(tensor, op.peer, op.group, op.tag)
                for kind, tensor, _, _, op in torch_ops
            ]
        rank = dist.get_rank()
        try:
            works = dist.batch_isend_irecv([op for *_, op in torch_ops])
        except (ValueError, TypeError):
            raise
        except Exception as exc:
            raise CommError(f"batch_isend_irecv on rank {rank} failed: {exc}") from exc
        handles = [
            Handle(kind, result=tensor, nbytes=nbytes, group=info.name, backend=self.name)
            for kind, tensor, nbytes, info, _ in torch_ops
        ]
        for h, (kind, *_, op) in zip(handles, torch_ops, strict=True):
            if kind == "irecv":
                h._source = int(op.peer)
        # Started at once: batched p2p ops usually depend on each other across ranks.
        stream = self._issue_stream()
        if len(works) == len(handles):
            for w, h in zip(works, handles, strict=True):
                h._engine = TorchOp(w, None, rank, stream)
                h._engine.start(h)
        else:  # one coalesced Work (NCCL): observe it once, complete all handles from it
            lead, rest = handles[0], handles[1:]

            def fan_out(done: Handle) -> None:
                for h in rest:
                    h._finish(done._exc)

            lead.add_done_callback(fan_out)
            lead._engine = TorchOp(_AllWorks(works), None, rank, stream)
            lead._engine.start(lead)
        return handles


class _AllWorks:
    """Several Works observed as one (waited in order on a waiter thread)."""

    def __init__(self, works: Sequence[Any]) -> None:
        self.works = list(works)

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True

    def get_future(self) -> Any:
        raise RuntimeError("no single future for several works")
