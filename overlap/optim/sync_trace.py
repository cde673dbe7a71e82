"""What DiLoCo records into a Tracer: each fragment's outer sync, where it was waited for,
and what the syncs cost the training thread.

Spans (:mod:`overlap.trace.recorder` categories, so the report and the Chrome export read
them as they read a BucketScheduler's):

* ``diloco issue fragment i`` (``user``, training thread): the pseudo-gradient (when taken
  there) and the post;
* ``diloco pseudo-gradient fragment i`` (``user``, the pass thread): a streaming sync's
  pseudo-gradient, taken while the next forward and backward run;
* ``reduce fragment i`` (``bucket``, args ``bucket=i``, ``bytes``, ``flow``, ``ready_ns``,
  ``step``, ``lands``): from the post to the moment the reduction completed (its Handle's
  ``end_ns``), recorded when the DiLoCo waits for it, so it is there once the wait
  returns (a done-callback ran after the waiter had gone on: a trace read right after
  the last landing missed its span); the report's bucket table then gives each
  fragment's reduce time, and ``ready_ns`` the issue's start;
* ``diloco wait fragment i`` (``wait``): the training thread blocked for a reduction at
  its landing, the stall plain DiLoCo shows at every sync and streaming should not;
* ``diloco land fragment i`` (``user``): the outer step and the merge;
* a step mark after every ``step()`` / ``astep()``, as the scheduler makes one per step.

Why a module of its own: the DiLoCo records only when a tracer was given, and this keeps
that bookkeeping out of the sync logic.
"""

from __future__ import annotations

import time
from typing import Any

from overlap.comm.handle import Handle

__all__ = ["SyncTrace"]

_now = time.perf_counter_ns


class SyncTrace:
    """Records one DiLoCo's syncs into ``tracer`` (an :class:`overlap.Tracer`)."""

    def __init__(self, tracer: Any) -> None:
        self.tracer = tracer
        # fragment -> (post time, span args) of its reduction, until it is seen complete
        self._reducing: dict[int, tuple[int, dict[str, Any]]] = {}

    def issued(self, i: int, t0: int, nbytes: int, step: int, lands: int, handle: Any) -> None:
        """Fragment ``i``'s reduction was posted (its issue began at ``t0``); its span is
        recorded by :meth:`waited` (at once if ``handle`` is already a result)."""
        tr = self.tracer
        posted = _now()
        tr.record(f"diloco issue fragment {i}", "user", t0, posted, fragment=i, step=step)
        args = {
            "bucket": i,
            "bytes": nbytes,
            "flow": tr.next_flow(),
            "ready_ns": t0,
            "step": step,
            "lands": lands,
        }
        if isinstance(handle, Handle):
            self._reducing[i] = (posted, args)
        else:
            tr.record(f"reduce fragment {i}", "bucket", posted, _now(), **args)

    def took(self, i: int, t0: int) -> None:
        """Fragment ``i``'s pseudo-gradient pass ran from ``t0`` to now (the pass thread)."""
        self.tracer.record(f"diloco pseudo-gradient fragment {i}", "user", t0, _now(), fragment=i)

    def waited(self, i: int, t0: int, handle: Handle) -> None:
        """The loop waited from ``t0`` for fragment ``i``'s ``handle``: that wait, and the
        reduction's span to the handle's completion (left for a later wait if the wait
        ended without it, e.g. cancelled)."""
        tr = self.tracer
        tr.record(f"diloco wait fragment {i}", "wait", t0, _now(), fragment=i)
        end = handle.end_ns
        if end is not None and i in self._reducing:
            posted, args = self._reducing.pop(i)
            tr.record(f"reduce fragment {i}", "bucket", posted, end, **args)

    def landed(self, i: int, t0: int, step: int) -> None:
        self.tracer.record(f"diloco land fragment {i}", "user", t0, _now(), fragment=i, step=step)

    def step(self) -> None:
        self.tracer.step()
