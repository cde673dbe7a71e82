"""DiLoCo and Streaming DiLoCo: infrequent outer synchronisation, awaitable.

Each rank trains on its own (inner optimizer, H steps); then the *pseudo-gradient* (global
weights minus local weights) is averaged across the ranks and an outer optimizer applies it
to the global weights, which become every rank's weights again (arXiv 2311.08105).

Streaming DiLoCo (arXiv 2501.18512) splits the parameters into F fragments that sync in
turn, each at its own offset within every H steps; a fragment's reduction is issued without
waiting and *lands* ``delay`` inner steps later, where the new global fragment is mixed into
the local weights that went on training meanwhile: local = alpha * local + (1 - alpha) *
global. The reduction runs on overlap's driver thread (:mod:`overlap.comm.driver`) while the
inner steps compute; ``astep()`` returns while it is in flight.

The schedule, for inner step t (1-based, counted by :meth:`DiLoCo.step`):

* fragment i *issues* at every t with t % H == offset_i, offset_i = ((i + 1) * H // F) % H
  (F = 1: t = H, 2H, ...: DiLoCo exactly);
* it *lands* at t + delay (delay = 0: in the same call, before it returns).

At a landing, for the fragment's parameters only: the outer optimizer steps the global
weights with the averaged pseudo-gradient as their ``.grad`` (every other parameter's
``.grad`` is None during that step, and restored after, so the outer momentum of other
fragments does not move); the result is the new global fragment. The global weights change
only after the reduction has fully landed, so a failed sync (a dead peer: CommError) leaves
them whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from overlap import comm
from overlap.agreement import agree_on_load, compare, optimizer_settings, param_signature
from overlap.argcheck import count
from overlap.buffer_sync import (
    buffer_steps,
    layout_error,
    layout_vote,
    layouts_agree,
    module_buffers,
    sync_steps,
)
from overlap.comm import driver
from overlap.comm import state as comm_state
from overlap.comm.steps import run, run_async
from overlap.compression.base import Compressor, NoCompression
from overlap.compression.codec_numba import kernel_module
from overlap.compression.quantize import BlockCodes, _BlockQuantized
from overlap.errors import NonFiniteError
from overlap.initial_sync import broadcast_state, module_state
from overlap.optim.late import LateLandings
from overlap.optim.sync_trace import SyncTrace
from overlap.ownership import claim, holder_of, release
from overlap.params import select, unfrozen_message
from overlap.rankstate import check_rank, group_rank
from overlap.unawaited import Unawaited

__all__ = ["OUTER_LR", "OUTER_MOMENTUM", "DiLoCo", "schedule", "spare_core"]

log = logging.getLogger(__name__)

# The default outer optimizer: Nesterov SGD. The paper's lr 0.7 / momentum 0.9 were tuned
# for H = 500; these were chosen by the sweep in docs/diloco.md (H = 8).
OUTER_LR = 0.6
OUTER_MOMENTUM = 0.3


def schedule(sync_every: int, fragments: int, delay: int, steps: int) -> list[tuple[int, str, int]]:
    """(step, "issue" | "land", fragment) events of steps 1..``steps``, in the order
    :meth:`DiLoCo.step` performs them: a step's landings first (by fragment), then its
    issues (each followed at once by its landing when ``delay`` is 0)."""
    _check_schedule(sync_every, fragments, delay)
    offs = offsets(sync_every, fragments)
    landing: dict[int, int] = {}
    out: list[tuple[int, str, int]] = []
    for t in range(1, steps + 1):
        for i in sorted(i for i, at in landing.items() if at == t):
            out.append((t, "land", i))
            del landing[i]
        for i in range(fragments):
            if t % sync_every == offs[i]:
                out.append((t, "issue", i))
                if delay == 0:
                    out.append((t, "land", i))
                else:
                    landing[i] = t + delay
    return out


def offsets(sync_every: int, fragments: int) -> list[int]:
    """Each fragment's sync offset within every ``sync_every`` steps."""
    return [((i + 1) * sync_every // fragments) % sync_every for i in range(fragments)]


def _check_schedule(sync_every: Any, fragments: Any, delay: Any) -> None:
    count("sync_every", sync_every, 1)
    count("fragments", fragments, 1)
    count("delay", delay, 0)
    if delay >= sync_every:
        raise ValueError(
            f"delay={delay} must be less than sync_every={sync_every}: a fragment's reduction "
            "has to land before the fragment syncs again; lower delay or raise sync_every"
        )


def split(sizes: list[int], fragments: int) -> list[list[int]]:
    """Parameter indices, in model order, cut into ``fragments`` contiguous runs of about
    equal element counts (each run at least one parameter)."""
    total = sum(sizes)
    out: list[list[int]] = [[] for _ in range(fragments)]
    acc, f = 0, 0
    for i, n in enumerate(sizes):
        left = len(sizes) - i
        if out[f] and (acc >= total * (f + 1) / fragments or left <= fragments - 1 - f):
            f += 1
        out[f].append(i)
        acc += n
    return out


def _nested_error(sched: Any, group: Any) -> str | None:
    """None when ``sched`` (a BucketScheduler over the same parameters) averages inside this
    rank's DiLoCo worker: its group and the DiLoCo's ``group`` meet only in this rank, so
    each averages what the other does not (hierarchical DiLoCo: a worker of several ranks
    trains as one, and the workers sync every H steps). Else why not: the two would
    average some ranks twice over."""
    inner = comm.get_all_ranks_from_group(sched.group)
    outer = comm.get_all_ranks_from_group(group)
    both = sorted(set(inner) & set(outer))
    if both == [comm.get_rank()]:
        return None
    return (
        f"this model's gradients are averaged by a BucketScheduler over ranks {inner}, and "
        f"this DiLoCo's group (ranks {outer}) shares ranks {both} with it: they would average "
        "the same ranks twice. To average inside each DiLoCo worker and sync across workers, "
        "give the BucketScheduler the ranks of this rank's worker and the DiLoCo one rank per "
        'worker, so that the two groups meet only in this rank (docs/diloco.md, "Workers of '
        'several ranks"); otherwise remove() the BucketScheduler'
    )


class DiLoCo:
    """Low-communication data parallelism: sync every ``sync_every`` inner steps.

    Args:
        model: the module whose trainable parameters are synced. Every rank builds the same
            model; rank 0 of ``group``'s parameters (frozen ones too) and buffers are
            broadcast at construction (as DDP does; overlap.initial_sync).
        inner_optimizer: the optimizer the training loop steps; DiLoCo never touches its
            state (checkpoint it yourself). It must update only the model's parameters.
        outer_optimizer: a torch optimizer over exactly the model's trainable parameters,
            stepping the global weights with the averaged pseudo-gradient; default Nesterov
            SGD (``OUTER_LR``, ``OUTER_MOMENTUM``).
        sync_every: H, inner steps between a fragment's syncs.
        fragments: F; 1 is DiLoCo, more is Streaming DiLoCo.
        delay: inner steps between issuing a fragment's reduction and merging its result
            (0 <= delay < H); 0 waits for it at once.
        compression: a :class:`~overlap.compression.Compressor` for the pseudo-gradients
            (``overlap.BF16()``, ``overlap.Int8()``, ``overlap.FP8()``; default none).
        group: the ranks that average (a data-parallel group); default the world.
        alpha: the merge's weight on the local weights at a landing: local = alpha * local
            + (1 - alpha) * global. Default 0: the global weights replace the local ones
            (DiLoCo exactly; with a delay the fragment's last ``delay`` local steps are
            dropped). The paper's 0.5 ended 5% worse at H = 8 (docs/diloco.md).
        tracer: an :class:`overlap.Tracer` to record into (attached if none is): each
            fragment's issue, its reduction (as a ``bucket`` span, to its completion), the
            training thread's wait at its landing, the landing itself, and a step mark per
            step (:mod:`overlap.optim.sync_trace`).
        pass_thread: take a streaming sync's pseudo-gradient (global - local, a read of the
            fragment's weights) on a thread of its own while the next forward and backward
            run, instead of inside :meth:`step`; the inner optimizer's next step waits for
            it (a step pre-hook), since that step writes the weights it reads. Writing the
            weights in place between :meth:`step` and the inner optimizer's step is then
            refused (RuntimeError at that step). Default None: when this host has a core to
            spare per process beyond torch's threads (:func:`spare_core`). Applies to
            float32 CPU weights with ``delay`` > 0.
        background: run each streaming reduction (``delay`` > 0) at the lowest CPU priority
            (nice 19, Linux; :mod:`overlap.comm.driver`, "Background jobs"), so that its
            codec work takes the CPU time the training threads leave over the ``delay``
            steps before its landing, instead of slowing the step after its issue. Default
            None: when this host has no core to spare per process (the opposite of
            ``pass_thread``'s choice). Measured on the 2-core machine (docs/diloco.md, "A
            background reduction"): the steps after an issue lost their 10-15 ms bump.

    Call :meth:`step` (or ``await`` :meth:`astep`) after every inner optimizer step. It
    returns at once when nothing is due. After the last one, :meth:`finish` (or ``await``
    :meth:`afinish`) ends every rank on the same model.
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        outer_optimizer: torch.optim.Optimizer | None = None,
        sync_every: int = 16,
        fragments: int = 1,
        delay: int = 0,
        compression: Compressor | None = None,
        group: Any = None,
        alpha: float = 0.0,
        tracer: Any = None,
        pass_thread: bool | None = None,
        background: bool | None = None,
    ) -> None:
        _check_schedule(sync_every, fragments, delay)
        for name, flag in (("pass_thread", pass_thread), ("background", background)):
            if flag is not None and not isinstance(flag, bool):
                raise TypeError(f"{name} must be True, False or None (auto), got {flag!r}")
        if tracer is not None:
            from overlap.trace.recorder import Tracer

            if not isinstance(tracer, Tracer):
                raise TypeError(f"tracer must be an overlap.Tracer, got {type(tracer).__name__}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        # the frozen parameters are skipped, and checked at each step() (params.py)
        self._selection = select(model, "DiLoCo")
        self._model = model  # its buffers agree at finish() (overlap.buffer_sync)
        # hierarchical DiLoCo: the BucketScheduler's group inside this rank's worker, whose
        # buffers finish() makes agree as well ((group,): None is the world group)
        self._worker: tuple[Any] | None = None
        self.params = self._selection.params
        if not self.params:
            raise ValueError("the model has no trainable parameters (requires_grad) to sync")
        if fragments > len(self.params):
            raise ValueError(
                f"fragments={fragments} but the model has {len(self.params)} trainable "
                f"parameters: a fragment is one or more whole parameters; use at most "
                f"{len(self.params)} fragments"
            )
        bad = sorted({str(p.dtype) for p in self.params if not p.dtype.is_floating_point})
        if bad:
            raise TypeError(f"DiLoCo syncs floating-point parameters, not {', '.join(bad)}")
        if not isinstance(alpha, (int, float)) or not 0.0 <= float(alpha) < 1.0:
            raise ValueError(f"alpha must be in [0, 1), got {alpha!r}")
        mine = {id(p) for p in self.params}
        # an optimizer over model.parameters() also holds the frozen ones, which it skips
        # (no gradient): that is the usual way to build one
        models = mine | {id(p) for _, p in self._selection.frozen}
        for name, opt in (
            ("inner_optimizer", inner_optimizer),
            ("outer_optimizer", outer_optimizer),
        ):
            if opt is None:
                continue
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"{name} must be a torch.optim.Optimizer, got {type(opt).__name__}")
            theirs = {id(p) for g in opt.param_groups for p in g["params"]}
            if theirs - models:
                raise ValueError(
                    f"the {name} updates parameters that are not this model's: build it "
                    "over model.parameters()"
                )
            if name == "outer_optimizer" and not mine <= theirs:
                raise ValueError(
                    f"the outer_optimizer covers {len(mine & theirs)} of the model's "
                    f"{len(mine)} trainable parameters: it must step all of them (build it "
                    "over model.parameters())"
                )
        if compression is not None and not isinstance(compression, Compressor):
            raise TypeError(
                f"compression takes a Compressor such as overlap.Int8() or overlap.BF16(), "
                f"got {compression!r}"
            )
        if getattr(compression, "name", None) == "auto":
            raise ValueError(
                "compression=Auto chooses by timing a BucketScheduler's steps, and DiLoCo's "
                "rare syncs give it no steps to time: pick one, e.g. overlap.Int8() for a slow "
                "link (docs/diloco.md, which method pays on which link)"
            )
        if outer_optimizer is inner_optimizer:
            raise ValueError("outer_optimizer must be a separate optimizer from inner_optimizer")
        held = next((h for p in self.params if (h := holder_of(p)) is not None), None)
        nested: str | None = None  # why a BucketScheduler under it may not be (see _start)
        if held is not None:
            from overlap.scheduler.scheduler import BucketScheduler

            if not isinstance(held, BucketScheduler):
                raise ValueError(
                    f"this model's parameters are already synced by a {type(held).__name__}: "
                    "remove() it first (overlap.holder_of(model) returns it where you no "
                    "longer hold it)"
                )
            nested = _nested_error(held, group)
            # a worker of several ranks (hierarchical DiLoCo): finish() makes the buffers
            # agree inside the worker too, after across the workers
            self._worker = (held.given_group,) if nested is None else None
        if compression is not None and (held := holder_of(compression)) is not None:
            raise ValueError(
                f"this {type(compression).__name__} is already used by a {type(held).__name__}: "
                "give DiLoCo its own compressor (it keeps per-fragment error state)"
            )
        self.inner = inner_optimizer
        self.outer = outer_optimizer or torch.optim.SGD(
            self.params, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True
        )
        self.sync_every, self.fragments, self.delay = sync_every, fragments, delay
        self.alpha = float(alpha)
        self.compression: Compressor = compression if compression is not None else NoCompression()
        self.group = group
        self.frags = split([p.numel() for p in self.params], fragments)
        self.offsets = offsets(sync_every, fragments)
        self._t = 0
        # fragment -> (landing step, Handle or the landed average)
        self._inflight: dict[int, tuple[int, Any]] = {}
        # fragment -> its pseudo-gradient buffer, kept: a fresh one per sync costs its page
        # faults every time (a fragment's next sync starts only after its landing)
        self._pseudo: dict[int, torch.Tensor] = {}
        # compiled or loaded now, not in a training step; None: landings run on torch ops
        self._kernels = kernel_module("overlap.optim.outer_kernels")
        # momentum buffers for the fused landing's first step on each parameter, touched now
        self._spare: dict[int, torch.Tensor] = {}
        self.syncs = 0
        self.bytes_sent = 0
        # seconds the training loop waited for reductions at their landings (this process
        # only; not in state_dict(): a wall-clock figure, counted anew after a resume)
        self.wait_s = 0.0
        # streaming: says once, in the log, when the landings keep waiting (overlap.optim.late)
        self._late = LateLandings(fragments) if delay > 0 else None
        self._removed = False
        # astep()/afinish() calls whose coroutine was dropped before it ran (unawaited.py)
        self._unawaited = Unawaited(
            "this rank skipped that step while its peers may have taken theirs, and "
            "the ranks' weights drift apart"
        )
        self.tracer = tracer
        self._trace = None if tracer is None else SyncTrace(tracer)
        # the job (init_distributed .. destroy_process_group) its syncs belong to
        self._generation = comm_state.generation
        self._swapped = False  # inside global_weights(): the model holds the globals
        # the task of the last astep(), while it runs (or a cancelled one's, until taken up)
        self._astepping: asyncio.Task[None] | None = None
        # the pseudo-gradient pass of a streaming sync, off the training thread: fragment ->
        # the pass (its result: the fragment's weights written while it read them); the
        # thread is made at the first such sync
        self._taking: dict[int, Future[list[int]]] = {}
        spare = spare_core(_cores(), comm.get_local_world_size(), torch.get_num_threads())
        self.pass_thread = spare if pass_thread is None else pass_thread
        # a streaming reduction at the lowest CPU priority (see the class docstring)
        self.background = (not spare if background is None else background) and delay > 0
        self._passes: ThreadPoolExecutor | None = None
        # seconds the training thread waited for such a pass (at the inner optimizer's step)
        self.pass_wait_s = 0.0
        self._start(module_state(model, self._selection), nested)
        self.globals = [p.detach().clone() for p in self.params]
        self._prepare()
        claim([*self.params, self.compression], self)
        # the inner optimizer's next step waits for a pass still reading the weights
        self._gate = inner_optimizer.register_step_pre_hook(self._before_inner_step)
        if tracer is not None:
            tracer.hold()  # released by remove()

    # ------------------------------------------------------------------ set-up
    def _start(self, state: list[torch.Tensor], nested: str | None = None) -> None:
        """Check every rank has the same parameters, buffers and schedule, then take rank
        0's parameters (frozen ones too) and buffers (overlap.initial_sync).

        ``nested``: why this rank's BucketScheduler may not sit under the DiLoCo (None: it
        may, or there is none). Agreed with the others before anything else, so a layout
        refused on some ranks only stops every rank here, not in a later collective."""
        g = self.group
        sig = param_signature(self.params)
        conf = [len(self.params), sig, self.sync_every, self.fragments, self.delay]
        conf += [len(state), param_signature(state), int(nested is not None)]
        # and what the syncs' collectives and the outer steps depend on (overlap.agreement)
        settings = {
            "compression": self.compression,
            "alpha": self.alpha,
            "outer_optimizer": optimizer_settings(self.outer),
        }
        ranks, refusal = compare("DiLoCo's", conf, settings, g, self._ctrl())
        if nested is not None:
            raise ValueError(nested)
        if refusal is not None:
            raise refusal
        if ranks:
            raise ValueError(
                f"DiLoCo differs across ranks: ranks {ranks} have other parameter or buffer "
                f"shapes or dtypes, another sync_every/fragments/delay, or a BucketScheduler "
                f"over ranks that this DiLoCo's group shares, unlike rank "
                f"{comm.get_global_rank(g, 0)}; build the same model and DiLoCo everywhere"
            )
        driver.ensure_twin(g)  # every rank is here now; a sync later may find a peer gone
        broadcast_state(state, g, self._ctrl())

    def _prepare(self) -> None:
        """Allocate and touch every buffer the syncs keep (pseudo-gradients, the
        compressor's, the fused landing's momentum), so their page faults are paid here and
        not by the first 2H inner steps: measured at 1 Gbit/s, the bench's streaming steps
        ran up to 1.4x compute-only until each fragment had synced twice."""
        for i, frag in enumerate(self.frags):
            n = sum(self.params[j].numel() for j in frag)
            dev = self.params[frag[0]].device
            # float32, or float64 where the fragment holds float64 weights: a float64
            # model's average is not rounded to float32 (a 1e-3 step moved 6e-11 off)
            wide = any(self.params[j].dtype == torch.float64 for j in frag)
            dtype = torch.float64 if wide else torch.float32
            flat = self._pseudo[i] = torch.zeros(n, dtype=dtype, device=dev)
            self.compression.prepare(i, flat, self.group, self._shapes(i))
        if self._kernels is not None and self._fusable_outer():
            for p in self.params:
                if self.outer.state.get(p, {}).get("momentum_buffer") is None:
                    self._spare[id(p)] = torch.zeros_like(p)

    def _ctrl(self) -> torch.device:
        return self.params[0].device if comm.get_backend() == "nccl" else torch.device("cpu")

    # ------------------------------------------------------------------ the loop
    @property
    def inner_steps(self) -> int:
        """Inner steps counted so far."""
        return self._t

    def _next_step(self) -> tuple[list[int], list[int]]:
        """step()'s and astep()'s common start: settle, count one inner step (its start
        for the late-landing watch too), and say which fragments land and issue now."""
        self._settle()
        self._t += 1
        if self._late is not None:
            self._late.step(time.perf_counter())
        return self._due_now()

    def _due_now(self) -> tuple[list[int], list[int]]:
        t = self._t
        land = sorted(i for i, (at, _) in self._inflight.items() if at == t and self.delay > 0)
        return land, self._issuing_at(t)

    def _issuing_at(self, t: int) -> list[int]:
        """The fragments whose sync is issued at inner step ``t``."""
        return [i for i in range(self.fragments) if t % self.sync_every == self.offsets[i]]

    def step(self) -> None:
        """Count one inner step; land and issue what is due (blocking for what lands)."""
        self._check_live()
        self._check_no_astep()
        self._check_job()
        self._check_frozen()
        self._check_kinds()
        land, issue = self._next_step()
        for i in land:
            w0 = self.wait_s
            self._land(i, self._wait(i))
            self._landed(self.wait_s - w0)
        for i in issue:
            self._issue(i)
            if self.delay == 0:
                self._land(i, self._wait(i))
        if self._trace is not None:
            self._trace.step()

    def astep(self) -> Coroutine[Any, Any, None]:
        """As :meth:`step`, awaiting each landing on the event loop; with a delay it returns
        while the issued reductions are in flight.

        Cancelling it (``asyncio.wait_for`` timing out) cancels the wait, not the step: its
        landings and issues go on as a task on this loop, because the peers land and issue
        the same fragments in step with this rank (a rank that dropped a landing halfway
        would keep other global weights than its peers, and one that skipped an issue would
        pair its later reductions with other fragments'). The next call waits for that task
        first (``astep``) or refuses while it runs (``step``, ``flush``, ``state_dict``), and
        raises its error if it failed.

        It must be awaited (or kept as a task): a coroutine dropped before it ran makes the
        next call raise RuntimeError, since that step never happened on this rank."""
        return self._unawaited.watch("diloco.astep()", self._astep())

    async def _astep(self) -> None:
        self._check_live()
        self._check_job()
        self._check_frozen()
        self._check_kinds()
        await self._in_order(self._astep_work)

    async def _in_order(self, work: Callable[[], Awaitable[None]]) -> None:
        """Run ``work`` as a task after the last astep()'s or afinish()'s, and await it
        shielded: cancelling the await cancels the wait, not the work (see :meth:`astep`).
        The task is made before anything is awaited, so the calls run in call order, even
        one cancelled at once."""
        task = asyncio.ensure_future(self._after(self._astepping, work))
        self._astepping = task
        try:
            await asyncio.shield(task)
        finally:
            if task.done() and self._astepping is task:
                self._astepping = None

    def _check_job(self) -> None:
        """Refuse to sync in another job than the one it was built in: after
        destroy_process_group() (and a new init_distributed()), its reductions' groups are
        gone (before: a KeyError, or a hang in a half-made group). What needs no
        collective (global_weights(), a state_dict() with nothing in flight) still works,
        e.g. saving the agreed model after the job ended."""
        if self._generation != comm_state.generation:
            raise RuntimeError(
                "this DiLoCo was built in a job that destroy_process_group() has since ended "
                "(its reductions' groups went with it, and the new job's ranks may differ): "
                "call remove() on it and build a new one after init_distributed(), carrying "
                "the state over with state_dict() and load_state_dict()"
            )

    def _check_frozen(self) -> None:
        """Refuse, before the step is counted, when a parameter frozen at construction now
        requires grad: no fragment holds it, so the ranks would train it apart. The ranks
        that unfroze it raise; if some did not, they wait for this rank's next reduction
        and get a CommError at the timeout."""
        unfrozen, changed = self._selection.unfrozen(), self._selection.changed
        if unfrozen or changed:
            raise ValueError(unfrozen_message(unfrozen, "DiLoCo", changed=changed))

    def _check_kinds(self) -> None:
        """Refuse, before the step is counted, a sync due now of a fragment whose parameters
        were cast or moved since this DiLoCo was built (``model.double()``, ``.to(...)``):
        its global weights and buffers keep the old dtype and device, so the sync ran in the
        old precision with no error (found by trying it). As the BucketScheduler's check;
        only at the steps that sync, only their fragments' parameters."""
        for i in self._issuing_at(self._t + 1):
            for j in self.frags[i]:
                p, g = self.params[j], self.globals[j]
                if p.dtype != g.dtype or p.device != g.device:
                    raise RuntimeError(
                        f"parameter {j} is now {p.dtype} on {p.device}, but it was {g.dtype} "
                        f"on {g.device} when this DiLoCo was built, and its global weights "
                        "are kept so: cast or move the model first, then build the DiLoCo "
                        "(remove() and a new DiLoCo)"
                    )

    def _astep_running(self) -> bool:
        task = self._astepping
        return task is not None and not task.done()

    def _check_no_astep(self) -> None:
        """A blocking call: refuse while a cancelled astep()'s task runs; raise its error."""
        task = self._astepping
        if task is None:
            return
        if not task.done():
            raise RuntimeError(
                "an astep() or afinish() whose await was cancelled is still landing or "
                "issuing its fragments in the background: `await diloco.astep()` (which "
                "waits for it first) or let the loop run until it is done"
            )
        self._astepping = None
        if not task.cancelled():
            task.result()  # its error, once

    @staticmethod
    async def _after(prev: asyncio.Task[None] | None, work: Callable[[], Awaitable[None]]) -> None:
        """``work()`` after the previous call's task (a cancelled astep() leaves its task
        running); that one's error is raised after this call's work, which the peers do
        too."""
        earlier: BaseException | None = None
        if prev is not None:
            try:
                await asyncio.shield(prev)
            except BaseException as exc:
                earlier = exc
        await work()
        if earlier is not None:
            raise earlier

    async def _astep_work(self) -> None:
        """One astep()'s landings and issues."""
        land, issue = self._next_step()
        for i in land:
            w0 = self.wait_s
            self._land(i, await self._await(i))
            self._landed(self.wait_s - w0)
        for i in issue:
            self._issue(i)
            if self.delay == 0:
                self._land(i, await self._await(i))
        if self._trace is not None:
            self._trace.step()

    def flush(self) -> None:
        """Land every in-flight fragment now (at the end of training, before evaluating or
        saving the final weights). Every rank must call it at the same step."""
        self._check_live()
        self._check_no_astep()
        self._check_job()
        self._settle()
        for i in sorted(self._inflight):
            self._land(i, self._wait(i))

    def finish(self) -> None:
        """End training on one model, the same on every rank, holding every rank's steps.

        Lands every fragment in flight (as :meth:`flush`), then syncs once more each
        fragment whose local weights differ from its global ones on any rank, and lands it
        with no merge: afterwards every rank's weights are the new global weights. Then the
        model's buffers agree as well: floating-point ones (BatchNorm's running statistics)
        averaged over the group, the others group rank 0's (:func:`overlap.sync_buffers`);
        ranks whose buffer layouts differ raise ValueError, every one, before anything is
        synced. With a BucketScheduler inside this rank's worker (hierarchical DiLoCo), the
        buffers are then made to agree over its group as well, so every rank of the job
        ends alike. Plain
        DiLoCo that ends on a sync step has nothing left to sync (then this is
        :meth:`flush`); Streaming DiLoCo usually has, since its fragments land at different
        steps (and with ``alpha`` > 0 a landing keeps the local weights apart).

        Why: each of the two other ends gives something up. A rank's local weights hold
        its own steps since each fragment last landed, on a per-rank batch that no other
        rank saw, and differ between ranks; the global weights drop those steps. On the
        bench's language model (three seeds, docs/diloco.md) streaming's local weights
        ended 2.2% behind plain DiLoCo's model on the mean and up to 3.6% on one seed; its
        finished model was within 2% on every seed (-0.0% on the mean), agreed by every
        rank.

        A collective: every rank of the group calls it at the same step (one MAX all-reduce
        of a float per fragment, and two for the buffer layout, agrees on what to sync, then
        one reduction per fragment synced, counted in :meth:`statistics`, then one per
        buffer dtype). Training may go on afterwards; the schedule
        continues where it was. Refused inside :meth:`global_weights`, while an astep()
        runs, after :meth:`remove`. A reduction that fails leaves that fragment's global
        weights as they were (the others synced by then keep their new ones).
        """
        self.flush()
        votes, buffers = self._finish_votes()
        comm.all_reduce(votes, op="max", group=self.group)
        due = self._issue_apart(votes)
        for i in due:
            self._land(i, self._wait(i), alpha=0.0)
        run(buffer_steps(buffers, self.group))
        if self._worker is not None:
            run(sync_steps(module_buffers(self._model), self._worker[0]))

    def afinish(self) -> Coroutine[Any, Any, None]:
        """:meth:`finish` in an event loop: each reduction awaited, the loop free meanwhile.
        It runs after any astep() still at work, and cancelling its await cancels the wait,
        not the finish, as for :meth:`astep` (the peers are in the same reductions). Like
        astep(), it must be awaited."""
        return self._unawaited.watch("diloco.afinish()", self._afinish())

    async def _afinish(self) -> None:
        self._check_live()
        self._check_job()
        await self._in_order(self._afinish_work)

    async def _afinish_work(self) -> None:
        self._settle()
        for i in sorted(self._inflight):
            self._land(i, await self._await(i))
        votes, buffers = self._finish_votes()
        await comm.all_reduce(votes, op="max", group=self.group, async_op=True)
        for i in self._issue_apart(votes):
            self._land(i, await self._await(i), alpha=0.0)
        await run_async(buffer_steps(buffers, self.group))
        if self._worker is not None:
            await run_async(sync_steps(module_buffers(self._model), self._worker[0]))

    def _finish_votes(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """finish()'s one MAX vote: :meth:`_apart` per fragment, then the model's buffer
        layout as ``[sig, -sig]`` (overlap.buffer_sync); and the buffers to sync."""
        named = module_buffers(self._model)
        tail = layout_vote(named, self._ctrl())
        return torch.cat([self._apart(), tail]), [b for _, b in named]

    def _apart(self) -> torch.Tensor:
        """This rank's vote, per fragment: 1 where its local weights differ from the
        global ones (to be MAX-reduced, so every rank syncs the same fragments)."""
        with torch.no_grad():
            apart = [
                float(any(not torch.equal(self.params[j], self.globals[j]) for j in frag))
                for frag in self.frags
            ]
        return torch.tensor(apart, dtype=torch.float32, device=self._ctrl())

    def _issue_apart(self, votes: torch.Tensor) -> list[int]:
        """Issue the reduction of every fragment the reduced ``votes`` name; those. Raises
        ValueError on every rank, before anything is issued, when the vote's buffer layouts
        (:meth:`_finish_votes`) differ."""
        if not layouts_agree(votes):
            raise ValueError(
                "DiLoCo.finish(): " + layout_error(comm.get_all_ranks_from_group(self.group))
            )
        due = [i for i, x in enumerate(votes[: len(self.frags)].tolist()) if x]
        for i in due:
            self._issue(i)
        return due

    @contextlib.contextmanager
    def global_weights(self) -> Iterator[None]:
        """Inside the block the model holds the global weights; on exit its local weights
        come back bit for bit.

        The global weights are the outer optimizer's result, the same on every rank: the
        model a DiLoCo run has agreed on (with fragments, each fragment as of its last
        landing). The local weights are what this rank trains, including its own inner
        steps since each fragment last landed. Evaluate or save the agreed model here
        without disturbing training. Local to this rank (no collective); reductions in
        flight go on untouched (their pseudo-gradients were taken at issue). Costs one
        copy of the parameters while inside.

        :meth:`step`, :meth:`astep`, :meth:`flush`, :meth:`finish`, :meth:`state_dict`
        and :meth:`load_state_dict` refuse inside it (a landing there would be undone on exit).
        Do not train inside it: the exit restores the weights as they were at entry. It
        refuses while an :meth:`astep` of another task is waiting for a landing.
        """
        self._check_live()
        if self._astep_running():
            raise RuntimeError(
                "an astep() or afinish() is waiting for a fragment to land, and the landing "
                "would write the weights this block swaps out: await it first"
            )
        self._settle()  # the block writes the weights a pass may still be reading
        with torch.no_grad():
            local = [p.detach().clone() for p in self.params]
            for p, g in zip(self.params, self.globals, strict=True):
                p.copy_(g)
        self._swapped = True
        try:
            yield
        finally:
            self._swapped = False
            with torch.no_grad():
                for p, x in zip(self.params, local, strict=True):
                    p.copy_(x)

    def _fragment(self, i: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for j in self.frags[i]:
            yield self.params[j], self.globals[j]

    def _issue(self, i: int) -> None:
        t0 = time.perf_counter_ns()
        flat = self._pseudo[i]  # made by _prepare
        ready = self._take(i, flat)
        # encoded: an Int8 average lands straight from its codes (the fused landing reads a
        # byte per element, and no decode pass is made); anything else decodes it first
        h = self.compression.reduce(
            i,
            flat,
            group=self.group,
            shapes=self._shapes(i),
            async_op=True,
            encoded=self._kernels is not None,
            ready=ready,
            background=self.background,
        )
        self._inflight[i] = (self._t + self.delay, h)
        self.syncs += 1
        self.bytes_sent += self.compression.wire_bytes(flat, self.group, self._shapes(i))
        if self._trace is not None:
            nbytes = flat.numel() * flat.element_size()
            self._trace.issued(i, t0, nbytes, self._t, self._t + self.delay, h)

    def _take(self, i: int, flat: torch.Tensor) -> Callable[[], Any] | None:
        """Fill ``flat`` with fragment ``i``'s pseudo-gradient (global - local weights).

        A streaming sync (``delay`` > 0) on float32 CPU weights takes it on the pass thread
        and returns what the reduction's job calls to wait for it: the pass reads the
        weights while the next forward and backward read them too, and the inner
        optimizer's next step (the first write) waits for it (:meth:`_settle`). About half
        of a streaming step()'s time on the training thread was this pass (4.6 of 9.8 ms,
        the bench's 25.2M-parameter model, 8 fragments). Otherwise (no ``pass_thread``,
        its landing is in this call, or no kernel applies) it is taken here; None."""
        pairs = list(self._fragment(i))
        offload = self.pass_thread and self.delay > 0 and self._kernels is not None
        if not (offload and all(_plain(p) and _plain(g) for p, g in pairs)):
            with torch.no_grad():
                a = 0
                for p, g in pairs:  # global - local, straight into the buffer
                    n = p.numel()
                    torch.sub(g.reshape(-1), p.reshape(-1), out=flat[a : a + n])
                    a += n
            return None
        if self._passes is None:
            self._passes = ThreadPoolExecutor(1, thread_name_prefix="overlap-diloco-pass")
        versions = [p._version for p, _ in pairs]
        fut = self._passes.submit(self._pass, i, pairs, flat, versions)
        self._taking[i] = fut
        return fut.result

    def _pass(
        self, i: int, pairs: list[tuple[torch.Tensor, torch.Tensor]], flat: torch.Tensor,
        versions: list[int],
    ) -> list[int]:  # fmt: skip
        """The pass thread's work for :meth:`_take`: the pseudo-gradient, then the indices
        (in the fragment) of the weights written while it read them (their version moved)."""
        t0 = time.perf_counter_ns()
        k = self._kernels
        a = 0
        for p, g in pairs:
            n = p.numel()
            out = flat[a : a + n].numpy()
            k.pseudo_gradient(g.view(-1).numpy(), p.detach().view(-1).numpy(), out)
            a += n
        if self._trace is not None:
            self._trace.took(i, t0)
        now = [p._version for p, _ in pairs]
        return [j for j, (v, w) in enumerate(zip(versions, now, strict=True)) if v != w]

    def _before_inner_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The inner optimizer's step pre-hook: it may write the weights now."""
        self._settle()

    def _settle(self) -> None:
        """Wait for every pseudo-gradient pass still reading the weights (the inner
        optimizer's next step, every DiLoCo call that writes or reads them). RuntimeError
        if a weight was written in place while its pass read it: that sync's
        pseudo-gradient may mix the weights before and after the write."""
        if not self._taking:
            return
        t0 = time.perf_counter_ns()
        taking, self._taking = self._taking, {}
        moved = {i: fut.result() for i, fut in sorted(taking.items())}
        self.pass_wait_s += (time.perf_counter_ns() - t0) / 1e9
        bad = [(i, self.frags[i][j]) for i, js in moved.items() for j in js]
        if bad:
            i, j = bad[0]
            raise RuntimeError(
                f"parameter {j} (shape {tuple(self.params[j].shape)}, fragment {i}) was "
                "written in place between DiLoCo.step() and the inner optimizer's next "
                f"step(), while DiLoCo read it for fragment {i}'s sync: that sync's "
                "pseudo-gradient may mix the weights before and after the write. Write the "
                "weights only in the inner optimizer's step (or before DiLoCo.step())"
            )

    def _wait(self, i: int) -> torch.Tensor | BlockCodes:
        _, h = self._inflight[i]
        if isinstance(h, (torch.Tensor, BlockCodes)):  # landed already (state_dict, load)
            return h
        t0 = time.perf_counter_ns()
        try:
            out: torch.Tensor | BlockCodes = h.wait()
        except BaseException:
            del self._inflight[i]  # the global weights are untouched
            raise
        finally:
            self._waited(i, t0, h)
        return out

    async def _await(self, i: int) -> torch.Tensor | BlockCodes:
        _, h = self._inflight[i]
        if isinstance(h, (torch.Tensor, BlockCodes)):
            return h
        t0 = time.perf_counter_ns()
        try:
            out: torch.Tensor | BlockCodes = await h
        except BaseException:
            del self._inflight[i]
            raise
        finally:
            self._waited(i, t0, h)
        return out

    def _waited(self, i: int, t0: int, handle: Any) -> None:
        """The loop waited from ``t0`` for fragment ``i``'s reduction ``handle``
        (``wait_s``; with a tracer, a ``wait`` span and the reduction's own)."""
        self.wait_s += (time.perf_counter_ns() - t0) / 1e9
        if self._trace is not None:
            self._trace.waited(i, t0, handle)

    def _landed(self, waited_s: float) -> None:
        """A streaming landing of step()/astep() is over, after waiting ``waited_s`` for its
        reduction: the first window of landings that waited more than a tenth of its time
        (and a tenth of a second) gets one warning that names the cause and the fix."""
        late = None if self._late is None else self._late.landed(waited_s, time.perf_counter())
        if late is None:
            return
        log.warning(
            "DiLoCo: fragment reductions arrive late: the inner steps waited %.0f ms for them "
            "at their landings over the last %d steps (%.0f%% of their %.0f ms). Each rank "
            "sends %.1f KiB a step on average (statistics()['steady_bytes_per_step']) and a "
            "reduction has delay=%d steps to arrive: raise sync_every (fewer bytes a step) "
            "or delay (more steps for each reduction), or look for a rank that is behind "
            "the others",
            late.waited_s * 1e3,
            late.steps,
            100 * late.waited_s / late.wall_s,
            late.wall_s * 1e3,
            self.steady_bytes_per_step() / 2**10,
            self.delay,
        )

    def _land(self, i: int, res: torch.Tensor | BlockCodes, alpha: float | None = None) -> None:
        """Outer step on fragment ``i`` with the averaged pseudo-gradient, then the merge
        (weight ``alpha`` on the local weights; default the DiLoCo's own)."""
        if self._trace is None:
            self._land_now(i, res, alpha)
            return
        t0 = time.perf_counter_ns()
        try:
            self._land_now(i, res, alpha)
        finally:
            self._trace.landed(i, t0, self._t)

    def _land_now(self, i: int, res: torch.Tensor | BlockCodes, alpha: float | None) -> None:
        del self._inflight[i]
        alpha = self.alpha if alpha is None else alpha
        k = self._kernels
        fused = k is not None and self._fusable(i, res)
        if isinstance(res, BlockCodes) and not fused:
            res = res.decode()
        if isinstance(res, BlockCodes):
            # Every scale is finite (the compressor raised otherwise), so every code * scale
            # is, unless a scale is within 128x of float32's largest: check that, not the
            # average (a read of the scales only, 1/1024 of it).
            finite = bool(torch.isfinite(res.scales.abs().max() * 128.0))
        elif fused:
            finite = k.all_finite(res.numpy())
        else:
            finite = bool(torch.isfinite(res).all())
        if not finite:
            raise NonFiniteError(
                f"DiLoCo: the averaged pseudo-gradient of fragment {i} holds NaN or Inf (a "
                "rank's weights diverged); the global weights were left unchanged",
                ranks=[],
            )
        if fused:
            self._land_fused(i, res, alpha)
            return
        assert isinstance(res, torch.Tensor)
        avg = res
        pairs = list(self._fragment(i))
        # every parameter the outer optimizer holds (frozen ones too): only this
        # fragment's may have a gradient for its step
        held = list({id(q): q for g in self.outer.param_groups for q in g["params"]}.values())
        saved = [q.grad for q in held]
        try:
            with torch.no_grad():
                local = [p.detach().clone() for p, _ in pairs] if alpha else []
                for q in held:
                    q.grad = None
                a = 0
                for p, g in pairs:
                    n = p.numel()
                    p.copy_(g)
                    p.grad = avg[a : a + n].view(p.shape).to(p.dtype)
                    a += n
            self.outer.step()
            with torch.no_grad():
                for k, (p, g) in enumerate(pairs):
                    g.copy_(p)
                    if alpha:
                        p.mul_(1.0 - alpha).add_(local[k], alpha=alpha)
        finally:
            for q, s in zip(held, saved, strict=True):
                q.grad = s

    def _fusable(self, i: int, res: torch.Tensor | BlockCodes) -> bool:
        """Whether fragment ``i``'s landing can run as one fused kernel pass per parameter
        (:mod:`overlap.optim.outer_kernels`): a plain torch SGD without weight decay,
        dampening, maximize or hooks (an LR scheduler's patched ``step`` counts as one), over
        contiguous float32 CPU tensors, the average float32 or Int8 codes. Anything else
        takes ``outer.step()`` itself."""
        opt = self.outer
        if not self._fusable_outer():
            return False
        avg = res.codes if isinstance(res, BlockCodes) else res
        want = torch.int8 if isinstance(res, BlockCodes) else torch.float32
        if not (avg.device.type == "cpu" and avg.dtype == want and avg.is_contiguous()):
            return False
        for p, g in self._fragment(i):
            if not (_plain(p) and _plain(g)):
                return False
            buf = opt.state.get(p, {}).get("momentum_buffer")
            if buf is not None and not _plain(buf):
                return False
        return True

    def _fusable_outer(self) -> bool:
        """The optimizer half of :meth:`_fusable`."""
        opt = self.outer
        if type(opt) is not torch.optim.SGD or "step" in vars(opt):
            return False
        if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks:
            return False
        from torch.optim import optimizer as _opt

        if _opt._global_optimizer_pre_hooks or _opt._global_optimizer_post_hooks:
            return False
        return not any(
            g["weight_decay"] or g["dampening"] or g["maximize"] or g["differentiable"]
            for g in opt.param_groups
        )

    def _land_fused(self, i: int, res: torch.Tensor | BlockCodes, alpha: float) -> None:
        """:meth:`_land`'s outer SGD step and merge, one kernel pass per parameter (from the
        Int8 codes themselves when the average came encoded)."""
        k = self._kernels
        q = res if isinstance(res, BlockCodes) else None
        avg = res.flat if isinstance(res, BlockCodes) else res
        group_of = {id(p): g for g in self.outer.param_groups for p in g["params"]}
        a = 0
        with torch.no_grad():
            for p, g in self._fragment(i):
                n = p.numel()
                grp = group_of[id(p)]
                m = float(grp["momentum"])
                st = self.outer.state[p]
                buf = st.get("momentum_buffer")
                has = buf is not None
                if m and not has:
                    spare = self._spare.pop(id(p), None)
                    if spare is None:
                        spare = torch.empty_like(p, memory_format=torch.contiguous_format)
                    buf = st["momentum_buffer"] = spare
                hyper = (has, m, bool(grp["nesterov"]), float(grp["lr"]), alpha)
                gv, pv = g.view(-1).numpy(), p.detach().view(-1).numpy()
                bv = (buf if m else g).view(-1).numpy()  # untouched when momentum is 0
                if q is not None:  # this parameter's codes start at q.at(a)
                    k.sgd_land_int8(
                        q.codes.numpy(), q.scales.numpy(), q.block, q.at(a), gv, pv, bv, *hyper
                    )
                else:
                    k.sgd_land(avg[a : a + n].numpy(), gv, pv, bv, *hyper)
                a += n

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The global weights, the outer optimizer's state, the schedule position, the
        compressor's error state and every in-flight fragment (waited for here, so this is a
        collective: every rank calls it at the same step). The inner optimizer's state and
        the model's weights are yours to save alongside."""
        self._check_live()
        self._check_no_astep()
        self._settle()
        for i in sorted(self._inflight):
            at, _ = self._inflight[i]
            res = self._wait(i)
            self._inflight[i] = (at, res.decode() if isinstance(res, BlockCodes) else res)
        return {
            "sync_every": self.sync_every,
            "fragments": self.fragments,
            "delay": self.delay,
            "alpha": self.alpha,
            "sizes": [p.numel() for p in self.params],
            "step": self._t,
            "globals": [g.clone() for g in self.globals],
            "outer": copy.deepcopy(self.outer.state_dict()),
            "inflight": {i: (at, t.clone()) for i, (at, t) in self._inflight.items()},
            "compression": self.compression.state_dict(),
            "rank": group_rank(self.group),
            "syncs": self.syncs,
            "bytes_sent": self.bytes_sent,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; ValueError (nothing changed, on every rank)
        if it is for another model or schedule, or if the ranks' states are of different
        steps.

        A collective, as :meth:`state_dict` is: every rank of the group calls it, each with
        its own state. One MAX all-reduce carries each rank's verdict on its own state and
        its step, so a state refused on one rank is refused on all, and states of different
        saves are refused. Why: a job killed while saving leaves some ranks' newest files
        one save older than the others'; before the forty-fourth session each rank loaded
        its own, and the ranks then synced at different steps of their schedules and
        averaged pseudo-gradients taken from different global weights, with no error."""
        self._check_live()
        self._check_no_astep()

        def check() -> list[float]:
            self._check_state(state)
            return [int(state["step"])]

        agree_on_load("DiLoCo.load_state_dict", check, ["step"], self.group, self._ctrl())
        self._load(state)

    def _check_state(self, state: dict[str, Any]) -> None:
        """:meth:`load_state_dict`'s checks of this rank's own state; raises ValueError."""
        for k in ("sync_every", "fragments", "delay", "alpha"):
            if state.get(k) != getattr(self, k):
                raise ValueError(
                    f"this state has {k}={state.get(k)!r} but this DiLoCo has "
                    f"{k}={getattr(self, k)!r}: build the DiLoCo as it was saved"
                )
        if state.get("sizes") != [p.numel() for p in self.params] or [
            tuple(g.shape) for g in state["globals"]
        ] != [tuple(g.shape) for g in self.globals]:
            raise ValueError("this state is for another model (its parameter sizes differ)")
        theirs = [len(g["params"]) for g in state["outer"]["param_groups"]]
        mine = [len(g["params"]) for g in self.outer.param_groups]
        if theirs != mine:
            raise ValueError(
                f"this state's outer optimizer has parameter groups of {theirs} parameters but "
                f"this DiLoCo's has {mine}: build the outer optimizer as it was saved"
            )
        self.compression.check_state(state["compression"])
        check_rank("DiLoCo", state.get("rank"), group_rank(self.group), state["compression"])

    def _load(self, state: dict[str, Any]) -> None:
        """Take ``state`` (checked on every rank): the reductions in flight finish first."""
        self._settle()
        for i in sorted(self._inflight):  # let collectives in flight finish everywhere
            self._wait(i)
        self._inflight.clear()
        with torch.no_grad():
            for g, s in zip(self.globals, state["globals"], strict=True):
                g.copy_(s)
        self.outer.load_state_dict(copy.deepcopy(state["outer"]))
        for p in self.params:  # a loaded momentum buffer makes the spare useless: free it
            if self.outer.state.get(p, {}).get("momentum_buffer") is not None:
                self._spare.pop(id(p), None)
        self.compression.load_state_dict(state["compression"])
        self._inflight = {int(i): (int(at), t.clone()) for i, (at, t) in state["inflight"].items()}
        self._t = int(state["step"])
        self.syncs = int(state.get("syncs", 0))
        self.bytes_sent = int(state.get("bytes_sent", 0))

    def steady_bytes_per_step(self) -> float:
        """Bytes this rank sends per inner step once every fragment syncs in turn: each
        fragment's reduction once per ``sync_every`` steps."""
        total = sum(
            self.compression.wire_bytes(
                torch.empty(sum(self.params[j].numel() for j in f), device="meta"),
                self.group,
                self._shapes(i),
            )
            for i, f in enumerate(self.frags)
        )
        return total / self.sync_every

    def _shapes(self, i: int) -> list[torch.Size] | None:
        """Fragment ``i``'s parameter shapes, for a block quantizer (Int8, FP8): each
        parameter then starts a block of its own, as in a BucketScheduler's buckets, and a
        small one (a bias, a norm's weight) is not quantized on a larger neighbour's scales
        (docs/compression.md, "Blocks per tensor"). None for any other compressor: a
        PowerSGD would take the shapes for matrices to factor, which it does not do to a
        fragment today."""
        if not isinstance(self.compression, _BlockQuantized):
            return None
        return [self.params[j].shape for j in self.frags[i]]

    def statistics(self) -> dict[str, Any]:
        """Inner steps, syncs issued, bytes this rank sent for them, seconds the training
        loop waited for reductions at their landings (``wait_s``), fragments in flight.
        ``late``: a cycle of a streaming DiLoCo's landings waited for more than a tenth of
        its time (and 0.1 s), which it also logged once (:mod:`overlap.optim.late`)."""
        return {
            "inner_steps": self._t,
            "syncs": self.syncs,
            "bytes_sent": self.bytes_sent,
            "bytes_per_step": self.bytes_sent / max(1, self._t),
            # the stall: plain DiLoCo waits for every sync, streaming should hardly wait
            "wait_s": self.wait_s,
            # the training thread waiting for a pseudo-gradient pass at the inner step
            "pass_wait_s": self.pass_wait_s,
            # streaming reductions at the lowest CPU priority (background=)
            "background": self.background,
            "steady_bytes_per_step": self.steady_bytes_per_step(),
            # a cycle of landings waited over a tenth of its time and 0.1 s: the schedule
            # does not fit the link (logged once; overlap.optim.late)
            "late": self._late is not None and self._late.said,
            "in_flight": sorted(self._inflight),
        }

    def remove(self) -> None:
        """Land nothing more and give the model back (a BucketScheduler may then take it).
        Reductions in flight are waited for (they are collectives), their results dropped."""
        if self._removed:
            return
        if self._astep_running():
            self._check_no_astep()  # raises: its landings still use the model
        self._astepping = None
        try:
            self._settle()
        except RuntimeError as exc:
            log.warning("DiLoCo.remove: %s", exc)
        self._gate.remove()
        if self._passes is not None:
            self._passes.shutdown()
            self._passes = None
        for i in sorted(self._inflight):
            try:
                self._wait(i)
            except Exception as exc:
                log.warning("DiLoCo.remove: an in-flight reduction failed: %s", exc)
        self._inflight.clear()
        self._pseudo.clear()  # the kept buffers go back with the DiLoCo
        self._spare.clear()
        self._selection.unwatch()
        release([*self.params, self.compression], self)
        if self.tracer is not None:
            self.tracer.release()
        self._removed = True

    def _check_live(self) -> None:
        if self._removed:
            raise RuntimeError("this DiLoCo was removed; build a new one to sync again")
        self._unawaited.check()
        if self._swapped:
            raise RuntimeError(
                "the model holds the global weights (inside `with diloco.global_weights():`), "
                "and leaving the block puts the local ones back, undoing anything done here: "
                "call step(), astep(), flush(), finish(), state_dict() or load_state_dict() "
                "after the block"
            )

    def __repr__(self) -> str:
        return (
            f"DiLoCo(sync_every={self.sync_every}, fragments={self.fragments}, "
            f"delay={self.delay}, alpha={self.alpha}, compression={self.compression!r})"
        )


def _plain(t: torch.Tensor) -> bool:
    """A contiguous float32 CPU tensor: what the numba kernels take."""
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


def _cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def spare_core(cores: int, ranks_here: int, threads: int) -> bool:
    """``pass_thread=None``'s choice: whether each of the ``ranks_here`` processes on this
    host has a core beyond its ``threads`` torch threads (``cores`` shared by them all).
    Without one the pass thread only takes its core from the training threads: measured on
    a 2-core host with 2 ranks of 1 thread each (docs/diloco.md, "Speed"), the training
    thread's step() fell from 9.7 to 5.5 ms and the step did not get faster (1.10-1.14x
    compute-only before, 1.13-1.15x after)."""
    return cores // max(1, ranks_here) > threads
