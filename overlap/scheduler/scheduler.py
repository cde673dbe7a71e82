"""BucketScheduler: reduce gradients bucket by bucket while backward is still running.

Life of a step:

1. During backward, a post-accumulate-grad hook per parameter copies its gradient into its
   bucket (nothing to copy with ``gradient_as_bucket_view=True``: ``.grad`` *is* the bucket).
   When a bucket has all its gradients it is ready, and ready buckets are launched strictly
   in bucket-index order (DESIGN.md contract 1): the compressor's reduction runs on the
   worker thread (a side stream on CUDA) while backward goes on.
2. ``synchronize()`` (or ``await wait()``) ends the step. One small allreduce on a control
   group tells every rank which parameters got a gradient anywhere (since the last step:
   a backward under ``no_sync()`` counts, as in DDP); parameters unused here but used
   elsewhere send their ``.grad`` if they have one (as DDP), zeros if not, so their buckets
   launch too (no hang, as DDP's ``find_unused_parameters=True``); it then waits for every
   bucket and copies the averaged gradients back into ``.grad``. Parameters unused on every
   rank keep their ``.grad``.
3. After the first step the buckets are rebuilt from the observed gradient-ready order,
   rank 0's order broadcast so every rank agrees.

The scheduler's collectives run on a group of their own (created at construction, same
ranks), so they never interleave with the caller's ops on the default group.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
import zlib
from collections.abc import Coroutine, Generator, Iterable, Iterator
from typing import Any

import torch
from torch.autograd.variable import Variable

from overlap import comm
from overlap.agreement import agree_on_load, compare, optimizer_settings, param_signature
from overlap.argcheck import positive_real
from overlap.comm import debug as _debug
from overlap.comm import state as comm_state
from overlap.comm.handle import Handle
from overlap.comm.siblings import groups_like
from overlap.comm.steps import Steps, run, run_async
from overlap.compression.base import Compressor, NoCompression, steps_of
from overlap.errors import CommError, IncompleteBackwardError, OutOfStepError
from overlap.initial_sync import broadcast_state, module_state
from overlap.ownership import claim, holder_of, release
from overlap.params import select, unfrozen_message
from overlap.rankstate import check_rank, group_rank
from overlap.scheduler.buckets import Bucket, assign_buckets
from overlap.scheduler.join import Join
from overlap.scheduler.streams import Launcher
from overlap.unawaited import Unawaited

__all__ = ["BucketScheduler"]

log = logging.getLogger(__name__)
MB = 1024 * 1024


def _traced(steps: Steps, tracer: Any, index: int) -> Steps:
    """``steps`` unchanged, with the local compute between its comm phases recorded (the
    tracer observes the stages; the reduction knows nothing of it). An error thrown in (a
    failed handle) goes on into ``steps``, as without a tracer, so the reduction sees it
    and its cleanup (a hierarchical bucket's shared-memory file) runs then, not at garbage
    collection."""
    t = time.perf_counter_ns()
    try:
        pending = next(steps)
    except StopIteration as stop:
        tracer.record(f"decompress bucket {index}", "user", t, time.perf_counter_ns(), bucket=index)
        return stop.value
    tracer.record(f"compress bucket {index}", "user", t, time.perf_counter_ns(), bucket=index)
    phase = 0
    while True:
        thrown: BaseException | None = None
        try:
            yield pending
        except BaseException as exc:  # a failed handle: the reduction's to handle, as run()
            thrown = exc
        phase += 1
        t = time.perf_counter_ns()
        try:
            pending = steps.send(None) if thrown is None else steps.throw(thrown)
        except StopIteration as stop:
            tracer.record(
                f"decompress bucket {index}", "user", t, time.perf_counter_ns(), bucket=index
            )
            return stop.value
        tracer.record(
            f"server step bucket {index}",
            "user",
            t,
            time.perf_counter_ns(),
            bucket=index,
            phase=phase,
        )


_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)


def _graph_task_id() -> int:
    """The running backward's graph task id (-1 outside one, or on a torch without it)."""
    return -1 if _TASK_ID is None else int(_TASK_ID())


def _settled(h: Handle) -> Handle:
    """A handle that completes, without error, once ``h`` has completed either way."""
    s = Handle("settle", result=None)
    h.add_done_callback(lambda _: s._finish(None))
    return s


def _copy_in(view: torch.Tensor, grad: torch.Tensor, scale: float | None) -> None:
    """view = grad (times ``scale``), in one pass where the dtypes allow."""
    if scale is None:
        view.copy_(grad)
    elif torch.promote_types(grad.dtype, view.dtype) == view.dtype:
        torch.mul(grad, scale, out=view)
    else:  # a narrower reduce dtype: mul cannot write it directly
        view.copy_(grad).mul_(scale)


# On DDP's uncompressed CPU path, a gradient of at least this many bytes is allreduced on
# its own, in place in .grad, instead of through the bucket: the copy into the bucket
# becomes an in-place scale and the copy back goes, one read and one write pass over the
# gradient fewer. Smaller ones share their bucket's op (a collective costs a round trip).
SOLO_BYTES = 1 << 20


def _direct_ok(grad: torch.Tensor, flat: torch.Tensor) -> bool:
    """Whether a compressor may write ``grad`` directly (and, one that reads its outputs,
    read it there): dense, contiguous float32 on the bucket's device, in a float32 bucket."""
    return (
        grad.dtype == torch.float32
        and flat.dtype == torch.float32
        and grad.layout == torch.strided
        and grad.is_contiguous()
        and grad.device == flat.device
    )


# signals that stop a step where it is on one rank (see BucketScheduler._interrupted)
_INTERRUPTS = (KeyboardInterrupt, SystemExit)


def _refuse_sparse(model: torch.nn.Module, reduced: set[int]) -> None:
    """Refuse, before any group is made, an ``nn.Embedding`` or ``nn.EmbeddingBag`` built with
    ``sparse=True`` whose weight this scheduler reduces: its gradient is sparse, which the
    hook would refuse anyway, but only in the middle of the first backward. Only those two
    torch modules: another module's ``sparse`` attribute may mean anything (sparse
    attention), and the hook still catches whatever they make."""
    for name, mod in model.named_modules():
        if not isinstance(mod, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
            continue
        if mod.sparse and id(mod.weight) in reduced:
            raise TypeError(
                f"{name or 'the model'} ({type(mod).__name__}) has sparse=True, so its "
                "gradient is sparse, and a BucketScheduler reduces dense gradients only: "
                "build it with sparse=False, or pass the scheduler the other parameters"
            )


class BucketScheduler:
    """Overlap (compressed) gradient reduction with backward.

    Args:
        model_or_params: a module or an iterable of parameters. Frozen parameters
            (``requires_grad=False``) are skipped; tied parameters are reduced once. One
            unfrozen later is refused at the end of the step (its gradient would not be
            averaged): rebuild the scheduler after changing ``requires_grad``. So is a
            parameter assigned into the module later (a new one, or one in place of another).
        bucket_cap_mb: bucket size cap; ``first_bucket_mb``: cap of the first bucket, small so
            the first collective starts early.
        compression: a Compressor (default NoCompression: a plain averaging allreduce), or
            ``"auto"``: an :class:`overlap.Auto` that measures NoCompression, FP16, OneBit
            and PowerSGD on the first steps and keeps the fastest (its choice and costs in
            ``statistics()["compression"]``).
        group: the ranks to reduce over (default: the world).
        average: average (default) or sum the gradients.
        gradient_as_bucket_view: make each ``.grad`` a view into its bucket (saves one copy and
            one gradient-sized buffer), like DDP's option of that name.
        reduce_dtype: reduce in this dtype (e.g. float32 for bf16 gradients); default: the
            gradient's own.
        rebuild_buckets: rebuild the buckets from the gradient-ready order after step 1.
        tracer: an :class:`overlap.Tracer` to record into (attached if none is): backward
            compute (first to last gradient hook), each bucket's compress / collective /
            decompress with a flow arrow from the moment it was ready, the copy-back, the
            exposed wait in synchronize, and a step mark per step.
        hierarchy: ``"node"`` reduces each bucket uncompressed inside each host, with the
            compressor only between hosts, then shares the result inside the host
            (:mod:`overlap.scheduler.hierarchy`); ``"flat"`` compresses across all ranks;
            ``"auto"`` (default) is node when the job has several hosts with several
            processes each (from the node ranks), else flat. Every rank passes the same.
        optimizer: a :class:`overlap.OneBitAdam` over the same parameters: its momentum is
            formed and 1-bit reduced bucket by bucket during backward once its warm-up is
            over (plain averaging before). It replaces ``compression=``; ``step()`` then only
            applies the update.
        init_sync: take group rank 0's parameters (frozen ones too) and, for a module, its
            buffers at construction, as DDP's option of that name does (default True): a
            rank that started from other weights would otherwise train another model for
            ever. False: every rank must already hold the same weights.
    """

    def __init__(
        self,
        model_or_params: torch.nn.Module | Iterable[torch.nn.Parameter],
        *,
        bucket_cap_mb: float = 25,
        first_bucket_mb: float = 1,
        compression: Compressor | str | None = None,
        group: Any = None,
        average: bool = True,
        gradient_as_bucket_view: bool = False,
        reduce_dtype: torch.dtype | None = None,
        rebuild_buckets: bool = True,
        tracer: Any = None,
        optimizer: Any = None,
        hierarchy: str = "auto",
        init_sync: bool = True,
    ) -> None:
        if not isinstance(model_or_params, torch.nn.Module):
            model_or_params = list(model_or_params)  # read twice: an iterator would be spent
        # first: parameters on the meta device and on another are "several devices" (select
        # refuses a meta one alone)
        given = (
            model_or_params.parameters()
            if isinstance(model_or_params, torch.nn.Module)
            else model_or_params
        )
        devices = sorted(
            {str(p.device) for p in given if isinstance(p, torch.Tensor) and p.requires_grad}
        )
        if len(devices) > 1:
            raise ValueError(
                f"parameters are on several devices {devices}; a BucketScheduler reduces one "
                "device's parameters: create one scheduler per device, or move the model"
            )
        # tied parameters reduced once, frozen ones skipped (and checked at each step)
        self._selection = select(model_or_params, "BucketScheduler")
        self.params: list[torch.nn.Parameter] = self._selection.params
        if not self.params:
            raise ValueError("no parameter requires grad: nothing to reduce")
        if isinstance(model_or_params, torch.nn.Module):
            _refuse_sparse(model_or_params, {id(p) for p in self.params})
        bucket_cap_mb = positive_real("bucket_cap_mb", bucket_cap_mb)
        first_bucket_mb = positive_real("first_bucket_mb", first_bucket_mb)
        if gradient_as_bucket_view and reduce_dtype is not None:
            other = sorted({str(p.dtype) for p in self.params if p.dtype != reduce_dtype})
            if other:
                raise ValueError(
                    f"gradient_as_bucket_view=True makes each .grad a view into its bucket, "
                    f"so the bucket must have the gradient's dtype, but reduce_dtype is "
                    f"{reduce_dtype} and some parameters are {', '.join(other)}: drop one of "
                    "the two options"
                )
        if getattr(optimizer, "_sched", None) is not None:
            optimizer._attach(self)  # raises: it names the scheduler that already holds it
        held = next((h for p in self.params if (h := holder_of(p)) is not None), None)
        if held is not None:
            under = (
                ". To average gradients inside each DiLoCo worker, build the BucketScheduler "
                "first (over the worker's ranks), then the DiLoCo (one rank per worker; "
                'docs/diloco.md, "Workers of several ranks")'
                if type(held).__name__ == "DiLoCo"
                else ""
            )
            raise ValueError(
                f"these parameters are already reduced by a {type(held).__name__} that was "
                "not removed: call remove() on it before building a BucketScheduler (both "
                "would average every gradient; overlap.holder_of(model) returns it where you "
                f"no longer hold it){under}"
            )
        if isinstance(compression, str):
            if compression != "auto":
                raise ValueError(
                    f"compression={compression!r}: the one name taken is 'auto'; otherwise "
                    "pass a Compressor, e.g. overlap.OneBit() or overlap.FP16()"
                )
            from overlap.compression.auto import Auto

            compression = Auto()
        if compression is not None and (held := holder_of(compression)) is not None:
            raise ValueError(
                f"this {type(compression).__name__} is already used by a "
                f"{type(held).__name__}: a compressor keeps per-bucket state (error feedback), "
                "so give each its own (or remove() the other one first: "
                "overlap.holder_of(compressor) returns it)"
            )
        self.device = self.params[0].device
        backend = comm.get_backend()
        want = "cuda" if backend == "nccl" else None
        if (want and self.device.type != want) or (backend == "gloo" and self.device.type != "cpu"):
            raise ValueError(
                f"parameters are on {self.device} but the {backend} backend reduces "
                f"{'cuda' if backend == 'nccl' else 'cpu'} tensors; move the model or "
                "initialise the matching backend"
            )
        # The control collectives (model check, used-parameter mask, rebuild order) run on the
        # backend's own device: NCCL reduces only CUDA tensors.
        self._ctrl_device = self.device if backend == "nccl" else torch.device("cpu")
        # known on a rank outside the group too, which groups_like then refuses on every rank
        ranks = comm.get_process_group_ranks(group)
        self.world = len(ranks)
        # the buckets' collectives, and the per-step used-parameter mask and the rebuild
        # (every rank of the job builds one at once: overlap.comm.siblings)
        self.group, self.ctrl = groups_like(ranks, 2, "BucketScheduler")
        self._groups_owned = [self.group, self.ctrl]  # freed by remove()
        # the caller's group (None: the world), which outlives the scheduler's own two: for
        # others' collectives over the same ranks (DiLoCo.finish's buffers inside a worker)
        self.given_group: Any = group
        self.reduce_dtype = reduce_dtype
        self.optimizer = optimizer
        self.hierarchical = False
        try:  # a refusal (the same on every rank) frees the groups just made
            self._module_state = module_state(model_or_params, self._selection)
            self._check_same_model(
                self._module_state,
                {
                    "bucket_cap_mb": int(bucket_cap_mb * MB),
                    "first_bucket_mb": int(first_bucket_mb * MB),
                    "compression": compression,
                    "average": bool(average),
                    "gradient_as_bucket_view": bool(gradient_as_bucket_view),
                    "reduce_dtype": self._bucket_dtype(reduce_dtype),
                    "rebuild_buckets": bool(rebuild_buckets),
                    "optimizer": optimizer_settings(optimizer),
                    "hierarchy": hierarchy,
                    "init_sync": bool(init_sync),
                },
            )
            if init_sync:
                broadcast_state(self._module_state, self.ctrl, self._ctrl_device)
            if optimizer is not None:
                compression = self._optimizer_reduction(optimizer, compression, average, ranks)
            self.compression = compression if compression is not None else NoCompression()
            self.hierarchical = self._hierarchy(hierarchy, group, optimizer)
        except BaseException:
            for g in self._groups_owned:
                comm.destroy_process_group(g)
            raise
        self.average = average
        self.grad_as_view = gradient_as_bucket_view
        self.reduce_dtype = reduce_dtype
        self.cap = int(bucket_cap_mb * MB)
        self._solo_bytes = SOLO_BYTES  # read once: every bucket layout of this run uses it
        self.first_cap = int(first_bucket_mb * MB)
        self.rebuild = rebuild_buckets
        self.tracer = tracer
        self._tracer_released = False
        if tracer is not None:
            tracer.hold()  # released by remove()
        self._pidx = {id(p): i for i, p in enumerate(self.params)}
        # what each parameter was when its bucket was laid out (see _hook)
        self._kinds = [(p.dtype, p.is_cuda) for p in self.params]
        self._set_buckets(
            assign_buckets(list(reversed(self.params)), self.cap, self.first_cap, reduce_dtype)
        )
        # DDP's path for uncompressed buckets on CPU: the hook scales each gradient by 1/W as
        # it copies it in (one pass, as DDP's mul_out), and the bucket's allreduce (a sum) is
        # issued right there on the autograd thread. No worker hop, and no division pass
        # after the allreduce. Measured: see docs/benchmarks.md (overlap-none vs DDP).
        # Decided per step (_new_step): an Auto may choose NoCompression after its trial.
        self._inline = False
        self._prescale: float | None = None
        self._launcher = Launcher(self.device)
        # the job (init_distributed .. destroy_process_group) its groups belong to
        self._generation = comm_state.generation
        self._origin_raised = False  # this rank's own out-of-step error was raised once
        self._lock = threading.Lock()
        self._no_sync = False
        # join() (uneven inputs): this rank has left its loop and shadows its peers' steps;
        # _all_joined: the last vote found every rank there; _trained: steps with this
        # rank's own backward since join() began (the most trained rank's weights win)
        self._joining = False
        self._joined = False
        self._all_joined = False
        self._trained = 0
        # An awaited end of step whose awaiter was cancelled goes on as a task, and the
        # next wait() takes it up: (the task, the step's number); see wait()
        self._finishing: tuple[asyncio.Task[None], int] | None = None
        # the backward a cancelled `await backward()` left running in its thread; see backward()
        self._running: asyncio.Future[None] | None = None
        # backward() calls whose coroutine was dropped before it ran (unawaited.py)
        self._unawaited = Unawaited("that backward did not happen here")
        self._steps_begun = 0  # _new_step() calls: which step a _finishing task ends
        self._step = 0
        self._rebuilt = False
        self._stats: dict[str, Any] = {}
        self._new_step()
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._hook)  # type: ignore[no-untyped-call]
            for p in self.params
        ]
        claim([*self.params, *self._compressors()], self)

    # ----------------------------------------------------------------------- structure
    def _optimizer_reduction(
        self, optimizer: Any, compression: Compressor | None, average: bool, ranks: list[int]
    ) -> Compressor:
        """Check ``optimizer=`` and return the bucket reduction it asks for."""
        from overlap.optim import OneBitAdam

        if not isinstance(optimizer, OneBitAdam):
            raise TypeError(
                f"optimizer= takes an overlap.OneBitAdam, got {type(optimizer).__name__}; for "
                "other optimizers leave optimizer= out (and pick compression= if you want it)"
            )
        if compression is not None:
            raise ValueError(
                "optimizer=OneBitAdam does its own 1-bit compression of the momentum; drop "
                "compression= (or use compression= with a plain torch optimizer)"
            )
        if not average:
            raise ValueError("optimizer=OneBitAdam needs averaged momenta: drop average=False")
        bad = sorted({str(self.reduce_dtype or p.dtype) for p in self.params} - {"torch.float32"})
        if bad:
            raise ValueError(
                f"optimizer=OneBitAdam forms and reduces the momentum in float32 buckets, not "
                f"{', '.join(bad)}: pass reduce_dtype=torch.float32 (or leave it out for "
                "float32 parameters)"
            )
        if optimizer.group is not None:
            theirs = [
                comm.get_global_rank(optimizer.group, i)
                for i in range(comm.get_world_size(optimizer.group))
            ]
            if theirs != ranks:
                raise ValueError(
                    f"the OneBitAdam averages over ranks {theirs} but the scheduler over "
                    f"{ranks}: give both the same group"
                )
        reduction: Compressor = optimizer._attach(self)
        return reduction

    def _hierarchy(self, hierarchy: str, group: Any, optimizer: Any) -> bool:
        """Wrap the compressor in a Hierarchical one when ``hierarchy`` resolves to node."""
        from overlap.scheduler.hierarchy import (
            Hierarchical,
            check_hierarchy,
            node_layout,
            resolve,
        )

        check_hierarchy(hierarchy)
        if hierarchy == "flat":
            return False
        if optimizer is not None:
            if hierarchy == "node":
                raise ValueError(
                    "hierarchy='node' does not apply to optimizer=OneBitAdam (its reduction "
                    "writes into the optimizer's momenta): use hierarchy='flat'"
                )
            return False
        world = comm.get_world_size(group) == comm.get_world_size()
        layout = node_layout(self.ctrl, self._ctrl_device) if world else None
        if not resolve(hierarchy, layout, world):
            return False
        assert layout is not None
        self.compression = Hierarchical(self.compression, *layout, device=self._ctrl_device)
        return True

    def _compressors(self) -> list[Compressor]:
        """The compressor, and the one a Hierarchical wraps: both held by this scheduler."""
        inner = getattr(self.compression, "inner", None) if self.hierarchical else None
        return [self.compression] + ([inner] if inner is not None else [])

    def _bucket_dtype(self, reduce_dtype: torch.dtype | None) -> str:
        """``reduce_dtype`` as it shapes the buckets: None and the parameters' own dtype
        are alike."""
        if reduce_dtype is None or all(p.dtype == reduce_dtype for p in self.params):
            return "the parameters' own"
        return str(reduce_dtype)

    def _check_same_model(self, tensors: list[torch.Tensor], settings: dict[str, Any]) -> None:
        """Every rank has the same trainable parameters and the same tensors to take from
        rank 0 (frozen parameters, buffers), by shape and dtype, and the same ``settings``
        (what decides which collectives a step issues: overlap.agreement); a collective."""
        mine = [len(self.params), param_signature(self.params)]
        mine += [len(tensors), param_signature(tensors)]
        what = "the BucketScheduler's"
        ranks, refusal = compare(what, mine, settings, self.ctrl, self._ctrl_device)
        if refusal is not None:
            raise refusal
        if ranks:
            raise ValueError(
                f"the parameters differ across ranks: ranks {ranks} have other shapes or "
                f"dtypes (of parameters or buffers) than rank "
                f"{comm.get_global_rank(self.ctrl, 0)}; every rank must build the same model "
                "before creating the BucketScheduler"
            )

    def _set_buckets(self, buckets: list[Bucket]) -> None:
        self.buckets = buckets
        self._where: dict[int, tuple[Bucket, int]] = {}
        for b in buckets:
            b.plan_solo(self._solo_bytes)
            for pos, p in enumerate(b.params):
                self._where[id(p)] = (b, pos)
                if self.grad_as_view and p.grad is not None:
                    # Only parameters that have a gradient become views: one no rank ever
                    # uses keeps .grad None, as in DDP (the hook attaches views on first use).
                    b.view_of(pos).copy_(p.grad)
                    p.grad = b.grad_view(pos)

    def _new_step(self) -> None:
        self._steps_begun += 1
        # In debug mode every collective first waits for a check on its group's debug
        # group. Issued inline from a gradient hook, a bucket's check held the training
        # thread while a rank that lacked that bucket's gradient (a parameter it did not
        # use) was in the step's vote on the other group: both ranks waited for ever. On
        # the worker thread only the worker waits, as for compressed buckets.
        self._inline = (
            type(self.compression.current()) is NoCompression
            and self.device.type == "cpu"
            and not _debug.enabled()
        )
        self._prescale = 1.0 / self.world if self._inline and self.average else None
        # DDP's path, less a pass: a large float32 gradient is scaled and reduced in place
        # in .grad (no copy into the bucket and back); see SOLO_BYTES
        self._solo = self._inline and not self.grad_as_view
        # A compressor that reads its inputs from the gradients (OneBit) saves the copy into
        # the bucket: one read and one write pass over every gradient (measured 3.2 ms per
        # 4.2M-float layer, about a fifth of the 1-bit step's own work; docs/architecture.md).
        cur = self.compression.current()
        self._reads = (
            cur.reads_outputs
            and cur.writes_outputs
            and self.average
            and not self.grad_as_view
            and self.device.type == "cpu"
        )
        for b in self.buckets:
            b.reset()
        self._next = 0
        self._launched: list[tuple[Bucket, list[Handle]]] = []  # each bucket's handles
        self._order: list[int] = []
        # Parameters whose gradient a backward under no_sync() accumulated since the last
        # step: used, as DDP counts them (its "locally used" map is reset only at a sync)
        self._accumulated: set[int] = set()
        self._timeline: list[dict[str, Any]] = []
        self._bwd: list[int] = []  # first and last gradient-hook time (ns) of this step
        # The backwards (autograd graph tasks) that gave this step a gradient and have not
        # finished: one left at the vote raised halfway (see _backward_began)
        self._open: set[int] = set()
        self._newest = -1  # the newest backward that gave this step a gradient
        # (parameter, its .grad, that tensor's version, the parameter's version) as each
        # hook left them: a .grad replaced or written, or a parameter written (an optimizer
        # step), between backward and synchronize() drops the step (_touched)
        self._marks: list[tuple[int, torch.Tensor, int, int]] = []

    # -------------------------------------------------------------------------- hooks
    def _hook(self, p: torch.Tensor) -> None:
        if self._generation != comm_state.generation:
            raise RuntimeError(self._ended_job())
        if self._no_sync:
            self._accumulated.add(self._pidx[id(p)])
            return
        if self._launcher.broken is not None:
            return
        if self._ending_in_background():
            raise RuntimeError(
                "a backward produced a gradient while the previous step was still ending in "
                "the background (its `await sched.wait()` was cancelled): `await "
                "sched.wait()` again to finish it before the next backward"
            )
        i = self._pidx[id(p)]
        if (p.dtype, p.is_cuda) != self._kinds[i]:
            # model.double() / .half() / .cuda() after the scheduler was built: the bucket
            # has the old dtype (a silent cast of every gradient, or torch refusing the view)
            was = self._kinds[i]
            raise RuntimeError(
                f"parameter {i} is now {p.dtype} on {p.device}, but it was {was[0]} on "
                f"{'cuda' if was[1] else 'cpu'} when the BucketScheduler was built, and its "
                "bucket is laid out for that: cast or move the model first, then build the "
                "scheduler (sched.remove() and a new BucketScheduler)"
            )
        grad = p.grad
        if grad is not None and grad.is_sparse:
            raise TypeError(
                "BucketScheduler got a sparse gradient (e.g. nn.Embedding(sparse=True)); "
                "it reduces dense gradients only: use sparse=False or exclude the parameter"
            )
        if grad is not None and grad.requires_grad:
            # backward(create_graph=True): before, a deep "mul(): functions with out=...
            # arguments don't support automatic differentiation" from the copy into the
            # bucket (or, unscaled, a bucket pulled into the graph)
            raise ValueError(
                f"parameter {i}'s gradient is part of the autograd graph (loss.backward("
                "create_graph=True)); the BucketScheduler averages gradients as plain data, so "
                ".grad would lose that graph and a derivative taken through it would be "
                "wrong. For a gradient penalty take the inner gradient with "
                "torch.autograd.grad(..., create_graph=True) and call a plain loss.backward(); "
                "for derivatives through .grad, average the gradients yourself "
                "(overlap.comm.all_reduce) instead of with a BucketScheduler"
            )
        with self._lock:
            task = _graph_task_id()
            b, pos = self._where[id(p)]
            if pos not in b.pending:
                if self._open - {task}:
                    raise RuntimeError(
                        "a backward raised before it finished and its step was not ended: "
                        "after a failed backward call sched.synchronize() (or await "
                        "sched.wait()), which raises IncompleteBackwardError on every rank "
                        "and readies the scheduler, then run the next backward"
                    )
                if 0 <= task < self._newest:
                    # This backward began before one that already fed the step (graph task
                    # ids grow): that one ran nested inside it, a reentrant checkpoint's.
                    # The gradient it sent was partial, so the step must not end as if whole:
                    # left open, this task drops the step on every rank at the vote.
                    self._backward_began(task)
                    raise RuntimeError(
                        f"parameter {i} got a gradient twice in one backward: "
                        "torch.utils.checkpoint(..., use_reentrant=True) does that to a "
                        "parameter used both inside and outside the checkpointed function. "
                        "Pass use_reentrant=False (torch's recommended form). This step is "
                        "dropped: sched.synchronize() (or await sched.wait()) raises "
                        "IncompleteBackwardError on every rank and readies the scheduler"
                    )
                # Autograd added this gradient to .grad before the hook ran, and .grad may
                # be what a bucket sends or has received (gradient_as_bucket_view, a
                # gradient reduced where it is): measured, a later synchronize() gave each
                # rank another .grad, with no error. Left open, this backward drops the
                # step on every rank at the vote, as a backward that raised halfway.
                self._open.add(task)
                raise RuntimeError(
                    "a second backward produced a gradient before synchronize(); call "
                    "sched.synchronize() (or await sched.wait()) after each backward, or wrap "
                    "accumulation steps in `with sched.no_sync():`. This step is dropped: "
                    "sched.synchronize() (or await sched.wait()) raises "
                    "IncompleteBackwardError on every rank and readies the scheduler"
                )
            if task >= 0 and task not in self._open:
                self._backward_began(task)
            view = b.view_of(pos)
            if grad is not None and not (self.grad_as_view and grad.data_ptr() == view.data_ptr()):
                if self._reads and _direct_ok(grad, b.flat):
                    b.sourced.add(pos)
                elif self._solo and pos in b.solo and _direct_ok(grad, b.flat):
                    if self._prescale is not None:
                        grad.mul_(self._prescale)
                    b.direct.add(pos)  # reduced where it is: no copy in, no copy back
                elif not self.compression.fill(p, view, grad):
                    _copy_in(view, grad, self._prescale)
                if self.grad_as_view:
                    p.grad = b.grad_view(pos)
            elif grad is not None and self._prescale is not None:
                view.mul_(self._prescale)  # .grad is the bucket: scale it in place, as DDP
            g = p.grad
            if g is not None:  # what synchronize() checks is still there (_touched)
                self._marks.append((i, g, g._version, p._version))
            b.pending.discard(pos)
            self._order.append(i)
            if self.tracer is not None:
                now = time.perf_counter_ns()
                if not self._bwd:
                    self._bwd = [now, now]
                self._bwd[1] = now
            if not b.pending:
                b.ready = True
                self._launch_ready()

    def _fill_unused(self, b: Bucket, pos: int) -> bool:
        """For bucket ``b``'s parameter ``pos``, which the step's last backward did not use
        on this rank: put its ``.grad`` into the bucket, as the hook would have, if it has
        one; False if it has none (the caller sends zeros), or if this rank has joined
        (a joined rank shadows with zeros, as DDP's join hook does).

        Why: DDP's rule, measured against ``DDP(find_unused_parameters=True)``. A parameter
        unused here sends its ``.grad`` when it has one: the gradient that backwards under
        ``no_sync()`` accumulated, or one left from an earlier step that was not zeroed.
        Before the forty-sixth session it sent zeros: an accumulation was lost from the
        average, a parameter that only the accumulation steps used kept each rank's own
        ``.grad`` (the weights drifted apart), and with ``gradient_as_bucket_view`` the
        zeros were written into ``.grad`` itself, which then read 0 where the docs (and DDP)
        leave a parameter unused on every rank untouched. Found by a differential fuzz
        against a per-rank reference."""
        p = b.params[pos]
        grad = p.grad
        if grad is None or self._joined:
            return False
        view = b.view_of(pos)
        if (
            grad.is_sparse
            or grad.requires_grad
            or (p.dtype, p.is_cuda) != self._kinds[self._pidx[id(p)]]
            or grad.numel() != view.numel()
        ):
            return False  # what the hook refuses: a used parameter's hook raises for it
        if self.grad_as_view and grad.data_ptr() == view.data_ptr():
            if self._prescale is not None:
                view.mul_(self._prescale)  # .grad is the bucket: scale it in place
        elif not self.compression.fill(p, view, grad):
            _copy_in(view, grad, self._prescale)
        if self.grad_as_view:
            p.grad = b.grad_view(pos)
        return True

    def _backward_began(self, task: int) -> None:
        """Note that backward ``task`` gave this step a gradient, until it finishes.

        Autograd runs a graph task's final callbacks only when it finishes without error,
        so a task still here at the vote raised halfway: some of its gradients reached the
        buckets (some maybe sent), the rest never will. A set, not one id: a reentrant
        checkpoint runs a nested backward inside the outer one, and a step may take two
        backwards over disjoint parameters."""
        self._open.add(task)
        self._newest = max(self._newest, task)
        Variable._execution_engine.queue_callback(  # type: ignore[attr-defined]
            functools.partial(self._open.discard, task)
        )

    def _launch_ready(self) -> None:
        if self._launcher.broken is not None:
            return  # out of step: nothing more is issued (synchronize() raises)
        if self._next == 0 and self.buckets and self.buckets[0].ready:
            self.compression.begin_step()
        while self._next < len(self.buckets) and self.buckets[self._next].ready:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, b: Bucket) -> None:
        if self._inline:
            self._launch_inline(b)
            return
        h = Handle(f"bucket{b.index}", result=b.flat, nbytes=b.nbytes, backend=comm.get_backend())
        self._launched.append((b, [h]))
        entry: dict[str, Any] = {"bucket": b.index, "bytes": b.nbytes, "ready": time.perf_counter()}
        self._timeline.append(entry)
        comp, group, shapes, w, average = (
            self.compression,
            self.group,
            b.shapes,
            self.world,
            self.average,
        )
        reads = comp.current().reads_outputs
        outputs = self._direct_outputs(b, reads)
        sourced = reads and bool(b.sourced)

        tracer = self.tracer
        ready_ns, ready_tid = time.perf_counter_ns(), threading.get_ident()
        flow = tracer.next_flow() if tracer is not None else 0

        def job() -> Steps:
            entry["start"] = time.perf_counter()
            t0 = time.perf_counter_ns()
            dev_events = None
            if tracer is not None and b.flat.is_cuda:  # GPU time of this reduction
                ev: Any = torch.cuda.Event
                dev_events = (ev(enable_timing=True), ev(enable_timing=True))
                dev_events[0].record()
            try:
                # ``outputs`` only to a compressor that takes it (the base contract): a
                # user's compressor written to the original signature keeps working.
                # ``read_outputs`` only where the hook left gradients out of the bucket.
                kw: dict[str, Any] = {"outputs": outputs} if outputs else {}
                if sourced:
                    kw["read_outputs"] = True
                steps = steps_of(
                    comp, comp.reduce_steps(b.index, b.flat, group=group, shapes=shapes, **kw)
                )
                yield from (steps if tracer is None else _traced(steps, tracer, b.index))
                if not average:
                    b.flat.mul_(w)
            finally:
                entry["end"] = time.perf_counter()
            if dev_events is not None and tracer is not None:
                dev_events[1].record()
                tracer.device_span(
                    f"reduce bucket {b.index} (GPU)",
                    "comm",
                    *dev_events,
                    bucket=b.index,
                    bytes=b.nbytes,
                )
            if tracer is not None:
                tracer.record(
                    f"reduce bucket {b.index}",
                    "bucket",
                    t0,
                    time.perf_counter_ns(),
                    bucket=b.index,
                    bytes=b.nbytes,
                    flow=flow,
                    ready_ns=ready_ns,
                    ready_tid=ready_tid,
                )
            return b.flat

        self._launcher.submit_steps(job(), h._finish, b.flat)

    def _direct_outputs(self, b: Bucket, reads: bool) -> list[tuple[int, torch.Tensor]]:
        """The gradients a compressor that ``writes_outputs`` may rebuild straight into,
        saving the copy back from the bucket: float32, dense, contiguous ``.grad`` tensors of
        parameters that produced a gradient here this step (so are used, and their .grad is
        theirs to overwrite). Averaging only: a sum would scale the bucket afterwards.
        A compressor with :meth:`~Compressor.direct_targets` names its own tensors.

        ``reads``: the compressor reducing this bucket reads its outputs. Gradients the hook
        left where they are go into the bucket now if they did not become outputs after
        all, or (``reads`` False) all of them."""
        out = self._outputs(b)
        for pos in sorted(b.sourced - b.direct if reads else b.sourced):
            grad = b.params[pos].grad
            if grad is None:  # dropped since the hook: nothing to send, as for an unused one
                b.view_of(pos).zero_()
            else:
                _copy_in(b.view_of(pos), grad, None)
        return out

    def _outputs(self, b: Bucket) -> list[tuple[int, torch.Tensor]]:
        targets = self.compression.direct_targets(b.index, b.params)
        if targets is not None:
            b.direct.update(range(len(b.params)))
            return [(b.offsets[pos], t) for pos, t in enumerate(targets)]
        if not (self.compression.current().writes_outputs and self.average) or self.grad_as_view:
            return []
        if b.flat.dtype != torch.float32:
            return []
        out = []
        for pos, p in enumerate(b.params):
            g = p.grad
            if pos not in b.zeroed and g is not None and _direct_ok(g, b.flat):
                # .data: the same memory, its own version counter, so the compressor's
                # writes leave .grad._version as the user left it (_touched)
                out.append((b.offsets[pos], g.data))
                b.direct.add(pos)
        return out

    def _launch_inline(self, b: Bucket) -> None:
        """Issue the bucket's (pre-scaled) sum allreduce from this thread, as DDP does.

        A bucket with :attr:`~Bucket.solo` tensors issues one allreduce per solo tensor (on
        its .grad when the hook scaled it there, else on its slot), then one per span of
        the others: the same ops on every rank, whoever has which gradient."""
        g = self.group
        if self._solo and b.solo:
            hs = [
                comm.all_reduce(self._solo_target(b, pos), op="sum", group=g, async_op=True)
                for pos in b.solo
            ]
            hs += [
                comm.all_reduce(b.flat[a:e], op="sum", group=g, async_op=True) for a, e in b.rest
            ]
        else:
            hs = [comm.all_reduce(b.flat, op="sum", group=g, async_op=True)]
        self._launched.append((b, hs))
        tracer = self.tracer
        now = time.perf_counter()
        self._timeline.append(
            {
                "bucket": b.index,
                "bytes": b.nbytes,
                "ready": now,
                "start": now,
                "handles": hs,
                "flow": tracer.next_flow() if tracer is not None else 0,
                "ready_tid": threading.get_ident(),
            }
        )

    def _solo_target(self, b: Bucket, pos: int) -> torch.Tensor:
        """What solo position ``pos`` reduces: its .grad, scaled there by the hook, or its
        slot of the bucket (a gradient the hook copied in, or none: zeros)."""
        grad = b.params[pos].grad
        if pos in b.direct:
            if grad is not None:
                return grad
            b.direct.discard(pos)  # dropped since the hook: nothing to send, as if unused
            b.view_of(pos).zero_()
        return b.view_of(pos)

    def _close_inline(self) -> None:
        """Fill in the inline buckets' end times (and trace spans) once they are done."""
        for e in self._timeline:
            hs = e.pop("handles", None)
            if hs is None or any(h.end_ns is None for h in hs):
                continue
            start_ns, end_ns = min(h.start_ns for h in hs), max(h.end_ns for h in hs)
            e["end"] = end_ns / 1e9
            if self.tracer is not None:
                self.tracer.record(
                    f"reduce bucket {e['bucket']}",
                    "bucket",
                    start_ns,
                    end_ns,
                    bucket=e["bucket"],
                    bytes=e["bytes"],
                    flow=e["flow"],
                    ready_ns=start_ns,
                    ready_tid=e["ready_tid"],
                )
            del e["flow"], e["ready_tid"]

    # -------------------------------------------------------------------- end of step
    def _copy_back(self, b: Bucket, used: list[bool]) -> None:
        """Bucket ``b``'s averages into its parameters' .grad (those the compressor did not
        write directly)."""
        for pos, p in enumerate(b.params):
            if not used[self._pidx[id(p)]]:
                continue  # unused on every rank: .grad untouched (None), as DDP
            if pos in b.direct:
                continue  # the compressor already wrote the average into .grad
            view = b.view_of(pos)
            if self.grad_as_view:
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = b.grad_view(pos)
            elif p.grad is None:
                p.grad = view.to(p.dtype).clone()
            else:
                p.grad.copy_(view)

    def _poison(self, used: list[bool]) -> None:
        """A skipped step (a compressor's ``on_nonfinite="skip"``, the same on every rank):
        every gradient this scheduler reduced becomes NaN, on every rank, whichever bucket
        held the non-finite value. A loss scaler (``torch.amp.GradScaler``) then skips the
        optimizer step and lowers its scale everywhere, as it does under DDP; left as they
        were, the ranks whose own gradient was finite would step and the others not."""
        for p in self.params:
            if used[self._pidx[id(p)]] and p.grad is not None:
                p.grad.fill_(float("nan"))

    def _abandon(self, handles: list[Handle]) -> Steps:
        """Let every one of ``handles`` settle, so none still writes into a bucket or .grad,
        then start a fresh step: the scheduler stays usable. For a failed step, before its
        error is raised again."""
        yield [_settled(h) for h in handles]
        self._launcher.wait_compute()
        self._new_step()

    def _finish_steps(self) -> Steps:
        if self._generation != comm_state.generation:
            self._new_step()
            raise RuntimeError(self._ended_job())
        tracer = self.tracer
        t_wait = time.perf_counter_ns()
        if tracer is not None and self._bwd:
            tracer.record("backward", "compute", self._bwd[0], self._bwd[1])
        launcher = self._launcher
        if launcher.broken is not None and (
            self._origin_raised or isinstance(launcher.origin, (CommError, *_INTERRUPTS))
        ):
            # before any collective (streams.py, "Out of step"): a peer may be gone
            raise (yield from self._stop_here(None))
        n, w, me = len(self.params), self.world, comm.get_rank(self.ctrl)
        # The parameters used on each rank, then per rank: its backward raised halfway, it
        # unfroze a parameter the buckets lack (either drops the step on every rank), it has
        # joined, a .grad or parameter changed after its hook (drops it too). Built and read in
        # Python, a bytearray under the tensor and one tolist() back: with tensor indexing,
        # nonzero() and any() the vote cost 83 us a step at 12 parameters and 319 us at
        # 1,000, against 6 and 82 (timeit, this machine).
        votes = bytearray(n + 5 * w)
        for i in self._order:
            votes[i] = 1
        for i in self._accumulated:
            votes[i] = 1
        if self._open:
            votes[n + me] = 1
        unfrozen, changed = self._selection.unfrozen(), self._selection.changed
        if unfrozen or changed:  # the model holds a trainable parameter the buckets lack
            votes[n + w + me] = 1
        touched = self._touched()
        if touched is not None:
            votes[n + 3 * w + me] = 1
        if self._joined:  # join(): this rank has no more batches
            votes[n + 2 * w + me] = 1
        elif self._order or self._accumulated:
            self._trained += 1
        # A reduction of this step failed here with this rank's own error (a bug in a
        # compressor): said in the vote, so that every rank stops at once. Before, a rank
        # whose worker had failed skipped the vote, and whether a peer's worker had failed
        # yet when it reached the vote was a race: ranks that all raised the same TypeError
        # at a bucket's first phase waited in the vote until the job's timeout (30 minutes
        # by default; for ever on MPI), in the first of 30 trials on 2 gloo ranks.
        if launcher.broken is not None:
            votes[n + 4 * w + me] = 1
        mask = torch.frombuffer(votes, dtype=torch.uint8).to(self._ctrl_device)
        try:
            yield [comm.all_reduce(mask, op="max", group=self.ctrl, async_op=True)]
        except BaseException as exc:
            if isinstance(exc, _INTERRUPTS):
                self._interrupted(exc)
                raise
            if isinstance(exc, CommError) or self._launcher.broken is not None:
                # a peer lost or out of step: stop too (re-raises exc itself, whose cause is kept)
                raise (yield from self._stop_here(exc))  # noqa: B904
            # The vote failed (e.g. cancelled): the buckets launched in backward are still
            # in flight, some pipelined on the worker, which advances them only on a flush.
            # Drive them to their end too, so none is left suspended (a hierarchical bucket
            # holding a shared-memory file, a write into .grad) when the caller gives up.
            with self._lock:
                issued = [h for _, bucket_hs in self._launched for h in bucket_hs]
            self._launcher.flush()
            yield from self._abandon(issued)
            raise
        got = mask.tolist()
        stopped = [comm.get_global_rank(self.ctrl, i) for i in range(w) if got[n + 4 * w + i]]
        if stopped or launcher.broken is not None:
            peers = None
            if launcher.broken is None:
                # a peer's worker failed: this rank's collectives it never issued end at the
                # backend's timeout; a CommError either way, as when the peer's failure came
                # after this rank's vote (then this rank learns of it from that timeout)
                peers = CommError(
                    f"rank{'s' if len(stopped) > 1 else ''} {', '.join(map(str, stopped))} "
                    "stopped issuing this BucketScheduler's collectives (a bucket's reduction "
                    "failed there with an error of its own; its log says which), so this rank "
                    "stops too. Create new process groups and a new BucketScheduler to go on"
                )
            raise (yield from self._stop_here(peers, from_vote=True))
        incomplete, woken, changers = (
            [comm.get_global_rank(self.ctrl, i) for i in range(w) if got[at + i]]
            for at in (n, n + w, n + 3 * w)
        )
        all_joined = all(got[n + 2 * w : n + 3 * w])
        used = [v != 0 for v in got[:n]]
        drop = bool(incomplete or woken or changers)
        if not any(used):
            self._new_step()
            if woken:
                raise ValueError(unfrozen_message(unfrozen, "BucketScheduler", woken, changed))
            if all_joined:  # every rank has left its loop: join() ends, nothing to reduce
                self._all_joined = True
                return None
            raise RuntimeError(
                "synchronize() was called but no rank produced a gradient since the last "
                "step: run loss.backward() first (or use `await sched.backward(loss)`)"
            )
        with self._lock:
            for b in self.buckets:
                if not b.ready:
                    for pos in b.pending:
                        if drop or not self._fill_unused(b, pos):  # dropped: zeros
                            b.view_of(pos).zero_()  # unused here: contribute zeros
                    # never a direct output: a parameter no rank used keeps its .grad
                    b.zeroed, b.pending = b.pending, set()
                    b.ready = True
            self._launch_ready()
            launched = list(self._launched)
            handles = [h for _, bucket_hs in launched for h in bucket_hs]
        self._launcher.flush()  # every bucket is in: drive the pipeline to the end
        # CPU: each bucket is copied back into .grad as soon as it is reduced, while later
        # buckets are still on the wire, instead of all of them after the last one (a serial
        # pass over every gradient at the end of the step). CUDA: after wait_compute().
        early = self.device.type == "cpu"
        try:
            if early:
                for b, hs in launched:
                    yield hs
                    if drop:
                        continue  # the step is dropped: nothing is copied back
                    t = time.perf_counter_ns()
                    self._copy_back(b, used)
                    if tracer is not None:
                        tracer.record(
                            "copy-back", "user", t, time.perf_counter_ns(), bucket=b.index
                        )
            else:
                yield handles
        except BaseException as exc:
            if isinstance(exc, _INTERRUPTS):
                self._interrupted(exc)
                raise
            if self._launcher.broken is not None:
                raise (  # noqa: B904
                    yield from self._stop_here(None if isinstance(exc, OutOfStepError) else exc)
                )
            # A bucket failed (e.g. NonFiniteError on every rank): skip this step, train on.
            yield from self._abandon(handles)
            raise
        if drop:
            # every bucket was sent (the ranks stay in step), but the step's gradients
            # cannot stand: one rank's is only partly in them, or was changed after its
            # hook, or a rank trains a parameter the buckets lack. Drop the step on every
            # rank, as a failed bucket's: nothing is copied back
            dropped: Exception
            if incomplete:
                dropped = IncompleteBackwardError(
                    f"the backward of rank{'s' if len(incomplete) > 1 else ''} "
                    f"{', '.join(map(str, incomplete))} raised before it finished, so this "
                    "step's gradients are dropped on every rank (the buckets were still sent, "
                    "so that the ranks stay in step): zero the gradients, skip "
                    "optimizer.step() and go on with the next batch; the scheduler is ready "
                    "for it",
                    ranks=incomplete,
                )
            elif changers:
                dropped = RuntimeError(self._touched_message(changers, touched))
            else:
                dropped = ValueError(
                    unfrozen_message(unfrozen, "BucketScheduler", woken, changed)
                    + " (this step's gradients are dropped on every rank)"
                )
            self._close_inline()
            yield from self._abandon(handles)
            raise dropped
        self._close_inline()
        self._launcher.wait_compute()
        self.compression.end_step()
        t_copy = time.perf_counter_ns()
        if tracer is not None:
            tracer.record("synchronize", "wait", t_wait, t_copy)
        if not early:
            for b in self.buckets:
                self._copy_back(b, used)
            if tracer is not None:
                tracer.record("copy-back", "user", t_copy, time.perf_counter_ns())
        if self.compression.step_skipped():
            self._poison(used)
        if tracer is not None:
            tracer.step()
        self._stats = {
            "step": self._step,
            "buckets": len(self.buckets),
            "launches": len(handles),
            "bytes": sum(b.nbytes for b in self.buckets),
            "direct": sum(len(b.direct) for b in self.buckets),  # rebuilt straight into .grad
            # read where backward left them, never copied into the bucket
            "read_in_place": sum(len(b.sourced & b.direct) for b in self.buckets),
            "timeline": list(self._timeline),
            # cumulative CPU seconds of the worker thread (CPU: the codec and the copies of
            # every bucket, which compete with backward for cores; docs/cluster.md)
            "worker_cpu_s": self._launcher.cpu_s,
        }
        self._step += 1
        try:
            if self.rebuild and not self._rebuilt:
                order = torch.tensor(
                    self._ready_order(), dtype=torch.int64, device=self._ctrl_device
                )
                yield [
                    comm.broadcast(
                        order,
                        src=comm.get_global_rank(self.ctrl, 0),
                        group=self.ctrl,
                        async_op=True,
                    )
                ]
                self._rebuild([self.params[i] for i in order.cpu().tolist()])
            at_end = self.compression.step_end_steps(self.ctrl, self._ctrl_device)
            if at_end is not None:  # e.g. Auto agreeing on its choice: before the next step
                yield from at_end
        except BaseException as exc:
            # A peer that stopped after its last bucket collective (it issued them all)
            # never joins these: stop too. Anything else: a fresh step, then the error
            # (before, the next backward said "a second backward" instead).
            if isinstance(exc, _INTERRUPTS):
                self._interrupted(exc)
                raise
            if isinstance(exc, CommError):
                raise (yield from self._stop_here(exc))  # noqa: B904
            self._new_step()
            raise
        self._new_step()
        return None

    def _touched(self) -> str | None:
        """What changed a used parameter's ``.grad``, or the parameter, after its hook this
        step, if anything: the .grad replaced or set to None, or written in place (its
        version moved; the scheduler's own writes go through ``.data`` or the bucket,
        which leave it alone), or the parameter written (an optimizer step). Why: the
        buckets read the gradient backward left, and some read it where it is, on the
        worker thread or as the collective runs (gradient_as_bucket_view, DDP's in-place
        large gradients, OneBit's read in place). Measured before the forty-seventh
        session: ``clip_grad_norm_`` or ``zero_grad()`` between backward and synchronize()
        lost the clipping without a word, left a .grad None or zero while its neighbours
        got the average, or ended the ranks with different gradients; ``optimizer.step()``
        before synchronize() stepped each rank on its own gradient, and the ranks' weights
        drifted apart with no error."""
        params = self.params
        for i, g, v, pv in self._marks:
            p = params[i]
            now = p.grad
            if now is not g:
                how = "set to None" if now is None else "replaced by another tensor"
                return f"parameter {i}'s .grad was {how}"
            if g._version != v:
                return f"parameter {i}'s .grad was changed in place"
            if p._version != pv:
                return (
                    f"parameter {i} itself was written (an optimizer step on this rank's own "
                    "gradient: the ranks' weights now differ; broadcast rank 0's, "
                    "overlap.broadcast_parameters(model.state_dict()), or reload a checkpoint)"
                )
        return None

    @staticmethod
    def _touched_message(ranks: list[int], here: str | None) -> str:
        return (
            f"a .grad or a parameter changed between backward and synchronize() on rank"
            f"{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
            f"{f' (here: {here})' if here else ''}: the buckets reduce the gradients "
            "backward left, some of them where they are, so this step's gradients are "
            "dropped on every rank (the buckets were still sent, so that the ranks stay in "
            "step). Read or change .grad, and step the optimizer, only after synchronize() "
            "(or await sched.wait()): clip_grad_norm_, GradScaler.unscale_, zero_grad() and "
            "optimizer.step() go after it, as after DDP's backward. Zero the gradients and "
            "go on with the next batch; the scheduler is ready for it"
        )

    def _ended_job(self) -> str:
        return (
            "this BucketScheduler was built in a job that destroy_process_group() has since "
            "ended, and its process groups went with it: call remove() on it (that frees "
            "what is left) and build a new one after init_distributed()"
        )

    def _interrupted(self, exc: BaseException) -> None:
        """A signal (Ctrl-C: KeyboardInterrupt, or SystemExit) stopped the end of the step on
        this rank, somewhere among its collectives: whether its peers got all of this
        step's is unknown, so it stops issuing (streams.py, "Out of step") and raises the
        interrupt at once, without waiting for anything (the user may be interrupting a
        hang). Later steps raise OutOfStepError. Before, the step was dropped and the next
        synchronize() voted again, pairing with another collective on its peers."""
        self._launcher.stop_for(exc)
        self._origin_raised = True  # the interrupt itself is what this step raises

    def _stop_here(
        self, exc: BaseException | None, from_vote: bool = False
    ) -> Generator[list[Handle], None, BaseException]:
        """This rank stopped issuing the buckets' collectives (streams.py, "Out of step"),
        or ``exc`` (a failed collective, or ``from_vote``: the CommError of peers that said
        in the step's vote they stopped) stops it now: return what to raise, now and at
        every later step, where it is raised before anything is sent. The error that
        stopped it is raised once (``exc``, or the launcher's: a bug of this rank's own, or
        a CommError from a collective whose peer stopped); later steps raise the launcher's
        OutOfStepError. The step's vote is cast when this rank's own error (not a failed
        collective, not an interrupt) stopped it during the step, with a bit that says so,
        so that every rank stops at once when all failed alike (a compressor's bug); after
        that, or after a failed collective, it is not cast any more: a peer still in step
        waits for it until its timeout, as for the buckets' collectives, and stops in turn.

        Waits until the worker has ended every reduction (none issues more, none writes
        into ``.grad`` later, a hierarchical bucket's shared-memory file is gone), which
        takes no longer than the phase it is in: the collectives already issued are not
        waited for (on a peer, one past the point where the other rank stopped ends only at
        the backend's timeout), and nothing is copied back."""
        launcher = self._launcher
        if exc is not None:
            launcher.stop_for(exc)
        yield [launcher.drained()]
        self._new_step()
        assert launcher.broken is not None
        if not self._origin_raised:
            self._origin_raised = True
            # a peer's stop learnt from the vote, while this rank's worker failed too: its own
            # error is the one to raise (ranks that all failed alike raise it alike)
            own = launcher.origin is not None and launcher.origin is not exc
            if exc is not None and not (own and from_vote):
                return exc
            if launcher.origin is not None:  # this rank's own error, which it also had
                return launcher.origin
        # a fresh traceback each step: re-raising one instance would chain them
        return launcher.broken.with_traceback(None)

    def _ready_order(self) -> list[int]:
        order = list(dict.fromkeys(self._order))
        rest = [i for i in reversed(range(len(self.params))) if i not in set(order)]
        return order + rest

    def _rebuild(self, ordered: list[torch.nn.Parameter]) -> None:
        grads = {id(p): p.grad for p in self.params}
        self._set_buckets(assign_buckets(ordered, self.cap, self.first_cap, self.reduce_dtype))
        if not self.grad_as_view:
            for p in self.params:
                p.grad = grads[id(p)]
        reset = getattr(self.compression, "reset", None)
        if reset is not None:
            reset()  # the bucket layout changed: per-bucket state no longer applies
        self._rebuilt = True
        log.info(
            "BucketScheduler: rebuilt %d buckets from the gradient-ready order", len(self.buckets)
        )

    # ------------------------------------------------------------------------ the API
    def synchronize(self) -> None:
        """End the step: every parameter's .grad holds the averaged (decompressed) gradient."""
        if self._running is not None and not self._running.done():
            raise RuntimeError(
                "the backward of a cancelled `await sched.backward(loss)` is still running in "
                "its thread: `await sched.wait()` to let it finish and end the step"
            )
        self._drop_running()
        task = self._taken_up()
        if task is None:
            run(self._finish_steps())
            return
        if not task.done():
            raise RuntimeError(
                "the previous step is still ending in the background (its `await "
                "sched.wait()` was cancelled): `await sched.wait()` again to finish it "
                "before calling synchronize()"
            )
        self._finishing = None
        task.result()  # the step a cancelled wait() left has ended: its outcome, as wait()'s

    async def wait(self) -> None:
        """``synchronize()`` without blocking the event loop (for a backward run elsewhere).

        Cancelling it (``asyncio.wait_for`` timing out, a task cancelled) cancels the wait,
        not the step, as for any Handle: the end of the step (the vote, the buckets, the
        copy back, the compressor's end of step) goes on as a task on this loop, because
        the peers go through it in step with this rank; a rank that dropped it halfway
        would leave them out of step (measured: with OneBit, the next steps failed on
        every rank). The next ``wait()`` takes that task up and returns its outcome; a
        backward before it raises (the step has not ended), so a ``wait()`` left un-awaited
        shows there; a ``synchronize()`` after it ends the step as the wait would have."""
        await self._backward_done()
        task = self._taken_up()
        if task is None:
            task = asyncio.ensure_future(run_async(self._finish_steps()))
            self._finishing = (task, self._steps_begun)
        try:
            await asyncio.shield(task)
        finally:
            if task.done():
                self._finishing = None

    def _ending_in_background(self) -> bool:
        """A cancelled wait()'s end of step still runs (see wait())."""
        return self._finishing is not None and not self._finishing[0].done()

    def _taken_up(self) -> asyncio.Task[None] | None:
        """The end-of-step task a cancelled wait() left, if the next wait() is to take it
        up: still running, or done with no backward since (a retry after a timeout). Once
        a later step has begun, its outcome is no longer anyone's: dropped (logged)."""
        if self._finishing is None:
            return None
        task, begun = self._finishing
        if not task.done() or (self._steps_begun == begun + 1 and not self._order):
            return task
        self._finishing = None
        if not task.cancelled() and task.exception() is not None:
            log.warning(
                "BucketScheduler: a step whose wait() was cancelled ended with %r, and a new "
                "step began before anyone awaited it",
                task.exception(),
            )
        return None

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> Coroutine[Any, Any, None]:
        """Run ``loss.backward()`` off the event loop, then ``await wait()``.

        If the backward raises after some of its gradients reached the buckets, the step
        is ended anyway (its peers are in it): every other rank raises
        IncompleteBackwardError, this one the backward's own error, and the scheduler is
        ready for the next step. Cancelling this call cancels the wait: the backward goes
        on in its thread (a thread cannot be stopped), and the next ``wait()`` waits for
        it before it ends the step.

        It must be awaited (or kept as a task): one dropped before it ran did no backward,
        and the next ``backward()`` raises RuntimeError naming it (before, every ``.grad``
        stayed None with no error and the model never trained)."""
        return self._unawaited.watch("sched.backward(loss)", self._backward(loss, **kwargs))

    async def _backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        loop = asyncio.get_running_loop()
        running = loop.run_in_executor(None, functools.partial(loss.backward, **kwargs))
        self._running = running
        try:
            try:
                await asyncio.shield(running)  # a cancel leaves it running: see _backward_done
            finally:
                if running.done():
                    self._running = None  # its outcome is this call's, not a later wait()'s
        except Exception:
            if not self._open:
                raise  # none of its gradients reached the scheduler: the step is untouched
            try:
                await self.wait()
            except IncompleteBackwardError:
                pass  # the peers raise it; this rank raises the backward's own error
            raise
        await self.wait()

    async def _backward_done(self) -> None:
        """Wait for a backward that a cancelled ``backward()`` left running (a cancel of
        this wait leaves it running too), then forget it."""
        if self._running is not None:
            await asyncio.wait([self._running])
        self._drop_running()

    def _drop_running(self) -> None:
        """Forget the finished backward a cancelled ``backward()`` left, logging its error
        (nobody awaits it; every rank sees it at the vote, as IncompleteBackwardError)."""
        running, self._running = self._running, None
        if running is not None and not running.cancelled() and running.exception() is not None:
            log.warning(
                "BucketScheduler: the backward of a cancelled backward() raised",
                exc_info=running.exception(),
            )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no reduction) inside the block, like DDP.no_sync."""
        prev, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = prev

    def join(self) -> Join:
        """Train on uneven inputs (DDP's ``join()``): every rank wraps its loop in
        ``with sched.join():`` (``async with`` in an event loop). A rank that runs out of
        batches first leaves the block and shadows its peers' steps with zeros until every
        rank has left; then every rank takes the weights and buffers of the rank that
        trained the most steps. The average divides by the world size throughout, as DDP's
        default. Every rank must use it: overlap.scheduler.join says how it works."""
        return Join(self)

    def statistics(self) -> dict[str, Any]:
        """The last finished step: buckets, launches, bytes, and a per-bucket timeline."""
        out = dict(self._stats)
        out["bucket_bytes"] = [b.nbytes for b in self.buckets]
        out["rebuilt"] = self._rebuilt
        out["steps"] = self._step
        out["compression"] = self.compression.statistics()
        return out

    def state_dict(self) -> dict[str, Any]:
        """The compressor's state (error feedback) and the bucket layout."""
        return {
            "world_size": self.world,
            "rank": group_rank(self.group),
            "step": self._step,
            "rebuilt": self._rebuilt,
            "layout": [[self._pidx[id(p)] for p in b.params] for b in self.buckets],
            "shapes": [tuple(p.shape) for p in self.params],
            "compression": self.compression.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (same world size and model, or a clear ValueError with
        nothing changed, on every rank).

        A collective over the scheduler's ranks, at a step boundary: every rank calls it with
        its own state, and one MAX all-reduce carries each rank's verdict on its state, its
        step and its bucket layout. A state refused on one rank is refused on all, and states
        of different saves (a job killed while saving leaves some ranks' newest files one
        save older) are refused: before the forty-fourth session each rank loaded its own
        with no error, and the ranks went on from other steps of their compressor's
        warm-up (or with other bucket layouts)."""

        def check() -> list[float]:
            self._check_state(state)
            return [int(state["step"]), zlib.crc32(repr(state["layout"]).encode())]

        what = "BucketScheduler.load_state_dict"
        agree_on_load(what, check, ["step", "bucket layout"], self.ctrl, self._ctrl_device)
        self._load(state)

    def _check_state(self, state: dict[str, Any]) -> None:
        """:meth:`load_state_dict`'s checks of this rank's own state; raises ValueError."""
        if state["world_size"] != self.world:
            raise ValueError(
                f"this scheduler state was saved on {state['world_size']} ranks "
                f"but this group has {self.world}; resume on as many ranks"
            )
        if [tuple(s) for s in state["shapes"]] != [tuple(p.shape) for p in self.params]:
            raise ValueError(
                "this scheduler state belongs to a model with other parameter "
                "shapes; load it into the same model"
            )
        if sorted(i for lay in state["layout"] for i in lay) != list(range(len(self.params))):
            raise ValueError(
                "this scheduler state's bucket layout does not cover this model's parameters "
                "once each; the state is corrupt or belongs to another model"
            )
        self.compression.check_state(state["compression"])  # refuse before changing anything
        check_rank("scheduler", state.get("rank"), group_rank(self.group), state["compression"])

    def _load(self, state: dict[str, Any]) -> None:
        """Take ``state``, checked on every rank."""
        self._set_buckets(
            assign_buckets(
                [self.params[i] for lay in state["layout"] for i in lay],
                self.cap,
                self.first_cap,
                self.reduce_dtype,
            )
        )
        if [[self._pidx[id(p)] for p in b.params] for b in self.buckets] != state["layout"]:
            self._set_buckets(self._layout_buckets(state["layout"]))
        self._step = state["step"]
        self._rebuilt = state["rebuilt"]
        self.compression.load_state_dict(state["compression"])
        self._new_step()

    def _layout_buckets(self, layout: list[list[int]]) -> list[Bucket]:
        out = []
        for i, lay in enumerate(layout):
            b = assign_buckets([self.params[j] for j in lay], 1 << 62, 1 << 62, self.reduce_dtype)[
                0
            ]
            b.index = i
            out.append(b)
        return out

    def remove(self) -> None:
        """Remove every hook, stop the worker and free the scheduler's two process groups
        (their sockets and threads); the parameters are left as they are. The parameters and
        the compressor (or optimizer) can then be given to a new scheduler. Idempotent.
        Every rank calls it (freeing a group is collective), at a step boundary."""
        if self._ending_in_background():
            raise RuntimeError(
                "the step is still ending in the background (its `await sched.wait()` was "
                "cancelled) and uses the scheduler's groups: `await sched.wait()` first, "
                "then remove()"
            )
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._selection.unwatch()
        self._launcher.close()
        release([*self.params, *self._compressors()], self)
        if self.tracer is not None and not self._tracer_released:
            self._tracer_released = True
            self.tracer.release()
        if self.hierarchical and comm.is_initialized():
            self.compression.destroy()  # type: ignore[attr-defined]
            self.hierarchical = False
        if self.optimizer is not None:
            self.optimizer._detach(self)
        groups, self._groups_owned = self._groups_owned, []
        if groups and comm.is_initialized():
            for g in groups:
                comm.destroy_process_group(g)

    def __repr__(self) -> str:
        return (
            f"BucketScheduler({len(self.params)} params in {len(self.buckets)} buckets, "
            f"compression={self.compression!r}, world={self.world})"
        )
