"""Multi-phase handles that finish on their own, in the same order on every rank.

An awaitable multi-phase op (``compressed_allreduce``, ``Compressor.reduce`` and
``all_reduce(algorithm="ring"|"naive")`` with ``async_op=True``) used to issue its later
phases only when someone waited on its handle. A handle that was dropped, polled with
``done()``, given only a callback, or abandoned when its event loop closed never finished,
and its peers hung in the next phase.

Now each such op is a *job* run to the end by a driver thread, whatever the caller does with
the handle. Two rules keep the ranks in step (DESIGN.md contract 1):

* a job's collectives run on a **private twin** of the caller's group (same ranks), so they
  never interleave with the caller's own ops on that group, whose order the driver cannot
  know;
* the jobs of one twin run **one after another, in submission order**, on that twin's own
  thread: the sequence of collectives on the twin is a function of the submission order
  alone, which is the same on every rank, as for any collective.

Twins are made with ordinary ``new_group`` calls, which every rank must make: a group of
every rank gets its twin on first use (every rank is a member and calls the op), a proper
subgroup when :func:`overlap.comm.new_group` makes it. (torch's member-only group creation,
``use_local_synchronization=True``, hangs once a subgroup exists: measured, torch 2.13.)

Because the twin's sequence is fixed, a job that ends early on one rank (an error of that
rank's own, say a user compressor's bug there) would leave that rank's next job pairing its
collectives with the rest of this job's on its peers: measured, two
``Compressor.reduce(async_op=True)`` calls after one that failed on rank 0 only returned
averages of the wrong calls' tensors on both ranks, as normal results. So a job that fails
with anything but ``NonFiniteError`` (which every rank raises after the same phase) or a
failed collective **stops the twin**: every later job on it fails with
:class:`~overlap.errors.OutOfStepError` without issuing anything. What the rank issued is a
prefix of its peers' sequence, so nothing pairs wrongly; a peer's next collective waits
until the backend's timeout, fails with CommError and stops that peer's twin the same way.
Bad arguments raise on the caller's thread before a job is submitted, so they never stop
a twin. A stopped twin stays stopped: async multi-phase ops on that group then need a new
group (:func:`overlap.comm.new_group`).

The cost: a thread hop at the start, no pipelining between two such ops on one group, and a
second group per subgroup. Blocking calls (``async_op=False``) still run on the caller's
thread and group.

**Background jobs.** A job submitted with ``background=True`` runs on a thread of its own at
the lowest CPU priority (nice 19, Linux), while the twin's thread waits for it: the FIFO
order is kept, and the job's CPU work (a codec's passes) takes the time the training
threads leave instead of their cores. For work with slack before anyone waits for it, on a
host without a core to spare: a Streaming DiLoCo reduction lands ``delay`` steps after its
issue, and at normal priority its Int8 passes slowed the step after each issue by 10-15 ms
on the 2-core machine (docs/diloco.md, "A background reduction"). Once the training thread
blocks on the result, the job has the core to itself. Elsewhere than Linux a thread's
priority cannot be set alone (``setpriority`` would lower the whole process), and the job
runs at normal priority.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from overlap.comm import claims as _claims
from overlap.comm import quiesce as _quiesce
from overlap.comm.handle import Handle
from overlap.comm.steps import Steps, in_step, run
from overlap.errors import OutOfStepError

__all__ = ["clear", "ensure_twin", "forget", "make_twin", "submit"]

log = logging.getLogger(__name__)

IDLE_S = 10.0  # a driver thread with nothing to do for this long exits (a new job restarts it)
BACKGROUND_NICE = 19  # a background job's thread (module docstring)


class _Driver:
    """One private group's FIFO of jobs and the thread that runs them."""

    def __init__(self, group: Any, name: str, borrowed: bool = False) -> None:
        self.group = group
        self.name = name
        # the group is the caller's own (a group of one, _twin): not ours to destroy
        self.borrowed = borrowed
        self.jobs: deque[tuple[Callable[[Any], Steps], Handle, Any, bool]] = deque()
        self.cv = threading.Condition()
        self.thread: threading.Thread | None = None
        self.closed = False
        # Set once, never cleared: every later job fails with it, unissued (module docstring)
        self.broken: OutOfStepError | None = None

    def submit(
        self, make: Callable[[Any], Steps], handle: Handle, ctx: Any, background: bool = False
    ) -> None:
        # Exit waits for the whole job, not only for each phase's op: between two phases
        # nothing else is observed (overlap/comm/quiesce.py).
        _quiesce.begin(handle)
        with self.cv:
            self.jobs.append((make, handle, ctx, background))
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self._loop, name=f"overlap-steps-{self.name}", daemon=True
                )
                self.thread.start()
            self.cv.notify()

    def _loop(self) -> None:
        _claims.internal_thread()  # it orders its own ops (overlap.comm.claims)
        while True:
            with self.cv:
                if not self.jobs and not self.closed:
                    self.cv.wait(IDLE_S)
                if not self.jobs:
                    self.thread = None
                    return
                make, handle, ctx, background = self.jobs.popleft()
            try:
                if self.broken is not None:
                    # a fresh traceback each time: re-raising one instance would chain them
                    raise self.broken.with_traceback(None)
                if background:
                    result = _in_background(make, self.group, ctx, self.name)
                else:
                    result = _run_job(make, self.group, ctx)
            except BaseException as exc:
                if self.broken is None and not in_step(exc):
                    self._stop(handle.op, exc)
                handle._finish(exc)
            else:
                handle._result = result
                handle._finish(None)
            finally:
                _quiesce.end(handle)

    def _stop(self, op: str, exc: BaseException) -> None:
        why = f"an async {op} failed on this rank ({type(exc).__name__}: {exc})"
        log.error("%s; group %s's async multi-phase ops issue no more collectives", why, self.name)
        self.broken = OutOfStepError(
            f"async multi-phase ops on group {self.name} stopped issuing collectives: {why}, "
            "so this rank's collectives on the group's private twin no longer match its "
            "peers' (any further one could pair with a different op on them). Make a new "
            "group with overlap.comm.new_group for further async compressed_allreduce, "
            "Compressor.reduce, coalesced or ring/naive ops (blocking calls, async_op=False, "
            "are unaffected)"
        )

    def close(self, join: float = 0.0) -> None:
        """Stop taking jobs; the thread finishes what is queued and exits. ``join``: wait up
        to that many seconds for it (the job is being torn down: a thread that outlives the
        teardown can abort the process at exit)."""
        with self.cv:
            self.closed = True
            self.cv.notify()
            thread = self.thread
        if join and thread is not None and thread is not threading.current_thread():
            thread.join(join)


def _run_job(make: Callable[[Any], Steps], group: Any, ctx: Any) -> Any:
    with ctx():
        return run(make(group))


def _lower_priority() -> None:
    """Lower the calling thread's CPU priority to nice ``BACKGROUND_NICE`` (Linux only:
    there a thread's priority is its own); elsewhere, or where it is forbidden, it stays."""
    if not sys.platform.startswith("linux"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except OSError as exc:  # a sandbox that forbids it: run at normal priority
        log.debug("background job: cannot lower the thread's priority (%s)", exc)


def _in_background(make: Callable[[Any], Steps], group: Any, ctx: Any, name: str) -> Any:
    """Run the job on a new thread at the lowest priority and wait for it here: its result,
    or its exception raised here. A thread per job, daemon as the driver's own: a sync every
    few steps makes the thread's start (about 0.1 ms) nothing, and nothing outlives it."""
    out: list[Any] = []

    def body() -> None:
        _claims.internal_thread()
        _lower_priority()
        try:
            out.append((True, _run_job(make, group, ctx)))
        except BaseException as exc:  # handed to the driver thread, which owns the handle
            out.append((False, exc))

    t = threading.Thread(target=body, name=f"overlap-steps-{name}-bg", daemon=True)
    t.start()
    t.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value


_drivers: dict[Any, _Driver] = {}
_lock = threading.Lock()


def _name(ranks: list[int]) -> str:
    return "ranks" + ",".join(map(str, ranks))


def _twin(group: Any) -> _Driver:
    """The driver of ``group``'s private twin (see the module docstring for who makes it)."""
    from overlap import comm

    key = group if group is not None else "world"
    d = _drivers.get(key)
    if d is not None:
        return d
    size = comm.get_world_size(group)
    ranks = [comm.get_global_rank(group, i) for i in range(size)]
    if size == 1:
        # a group of one: no peer whose op order a job could cross, so it runs on the group
        # itself (a one-rank group made by its member alone has no twin, and needs none)
        with _lock:
            d = _drivers.get(key)
            if d is None:
                d = _drivers[key] = _Driver(group, _name(ranks), borrowed=True)
        return d
    if size != comm.get_world_size():
        raise ValueError(
            "async multi-phase ops (compressed_allreduce, Compressor.reduce, ring/naive "
            "all_reduce with async_op=True, a DiLoCo) on a subgroup need a group that every "
            "rank made with overlap.comm.new_group (it makes the subgroup's private twin "
            "then); this one was not (one made with use_local_synchronization=True, as "
            "PipelineParallelGrid(process_group=...) makes its groups, has none): make the "
            "group with overlap.comm.new_group(ranks) on every rank, or pass async_op=False"
        )
    with _lock:
        d = _drivers.get(key)
        if d is None:
            d = _drivers[key] = _Driver(comm.new_group(ranks), _name(ranks))
    return d


def ensure_twin(group: Any) -> None:
    """Make ``group``'s twin now if it has none yet. Call it where every rank of the job
    is making the same collective call (a constructor that runs collectives anyway, as
    DiLoCo's): a world group's twin made lazily at the first async op needs every rank
    there, which a peer that has died or stalled by then is not (the survivors would get
    the store's timeout instead of the CommError the op promises)."""
    _twin(group)


def make_twin(group: Any, ranks: list[int], new_group: Callable[[], Any]) -> None:
    """Called by ``new_group`` on every rank for a proper subgroup: make its twin now, while
    every rank is calling (members keep it; other ranks get a non-member group)."""
    from overlap.comm.groups import NonMemberGroup

    twin = new_group()
    if not isinstance(group, NonMemberGroup) and type(group).__name__ != "NonMemberGroup":
        with _lock:
            _drivers[group] = _Driver(twin, _name(ranks))


def submit(
    op: str,
    make: Callable[[Any], Steps],
    group: Any,
    *,
    nbytes: int = 0,
    backend: str = "",
    device: Any = None,
    world: int = 1,
    background: bool = False,
) -> Handle:
    """Run ``make(twin_group)`` (a steps generator) to the end on ``group``'s driver; the
    returned Handle completes with its result or error. ``device``: a CUDA device makes the
    job run on the caller's current stream of that device. ``background``: at the lowest
    CPU priority, in the same order (module docstring)."""
    d = _twin(group)
    handle = Handle(op, result=None, nbytes=nbytes, backend=backend, world=world)
    d.submit(make, handle, _context(device), background)
    return handle


def _context(device: Any) -> Any:
    if device is None or getattr(device, "type", "cpu") != "cuda":
        return contextlib.nullcontext
    import torch

    stream = torch.cuda.current_stream(device)

    @contextlib.contextmanager
    def on_callers_stream() -> Any:
        with torch.cuda.device(device), torch.cuda.stream(stream):
            yield

    return on_callers_stream


def clear() -> list[Any]:
    """Forget the twins (the job is being destroyed): their threads finish what is queued
    (failing, once the backend is gone) and exit. Returns the twin groups, for the caller
    to destroy with the job (a gloo group left to interpreter exit aborts the process)."""
    with _lock:
        drivers = list(_drivers.values())
        _drivers.clear()
    for d in drivers:
        d.close(join=5.0)
    return [d.group for d in drivers if not d.borrowed]


def forget(group: Any) -> Any:
    """Drop ``group``'s twin (``group`` is being destroyed); returns the twin group for the
    caller to destroy too, or None if ``group`` never had one."""
    with _lock:
        d = _drivers.pop(group, None)
    if d is None:
        return None
    d.close(join=5.0)
    return None if d.borrowed else d.group
