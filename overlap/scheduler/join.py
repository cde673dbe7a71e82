"""Uneven inputs: ranks whose data runs out at different steps (DDP's ``join()``).

Without it, a rank that has no more batches leaves its loop while its peers take another
step: their buckets and their vote wait for it until the backend's timeout, then every rank
stops with a CommError. DDP's answer, which :meth:`BucketScheduler.join` follows:

* every rank wraps its training loop in ``with sched.join():`` (``async with`` in an event
  loop);
* a rank that leaves the block *shadows* its peers' steps: it ends steps with no backward
  of its own (``synchronize()``), so the vote sees no gradient from it and its buckets go
  out as zeros, in the same order as everyone's. The average stays the sum over the job
  divided by the world size, as DDP's ``divide_by_initial_world_size=True`` (its default)
  gives;
* each rank's vote carries one more flag, "this rank has joined". The step at which every
  rank has joined has no gradient anywhere; every rank sees the same flags in it, so every
  rank leaves together, with no collective left unpaired;
* then the weights and buffers of the rank that trained the most steps (the highest such
  rank on a tie; DDP takes the last rank to join) are broadcast to all, so every rank ends
  with the same model: a rank that joined early stopped updating its own.

A rank whose block raises does not shadow (the error goes to the caller); its peers then
fail at their timeout, as without ``join()``.
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import TYPE_CHECKING

import torch

from overlap import comm
from overlap.initial_sync import broadcast_state

if TYPE_CHECKING:
    from overlap.scheduler.scheduler import BucketScheduler

log = logging.getLogger(__name__)

__all__ = ["Join"]


class Join:
    """The context :meth:`BucketScheduler.join` returns (``with`` or ``async with``)."""

    def __init__(self, sched: BucketScheduler) -> None:
        self.sched = sched
        self.steps_shadowed = 0  # steps this rank ended with no backward, after its block

    def _begin(self) -> None:
        s = self.sched
        if s._joining:
            raise RuntimeError("join() is already active on this BucketScheduler")
        s._joining = True
        s._joined = s._all_joined = False
        s._trained = 0

    def _shadowing(self, exc_type: type[BaseException] | None) -> bool:
        """Whether to shadow the peers: the block ended normally. Marks this rank joined."""
        s = self.sched
        if exc_type is not None:
            s._joining = s._joined = False
            return False
        s._joined = True
        return True

    def _shadowed(self) -> bool:
        """After one step this rank ended with no backward: True once it was the step where
        every rank had joined, after the final sync (a short blocking broadcast, once at
        the end of training, in the async form too)."""
        if self.sched._all_joined:
            self._final_sync()
            return True
        self.steps_shadowed += 1
        return False

    def _end(self) -> None:
        s = self.sched
        s._joining = s._joined = s._all_joined = False

    def _final_sync(self) -> None:
        """Every rank takes the most trained rank's parameters and buffers. A collective:
        every rank runs it once all have joined."""
        s = self.sched
        w = s.world
        me = comm.get_rank(s.ctrl)
        vote = torch.tensor([s._trained * w + me], dtype=torch.int64, device=s._ctrl_device)
        comm.all_reduce(vote, op="max", group=s.ctrl)
        root = int(vote.item()) % w
        broadcast_state(s._module_state, s.ctrl, s._ctrl_device, root=root)
        src = comm.get_global_rank(s.ctrl, root)
        log.info(
            "join(): every rank has joined (this one shadowed %d steps); the weights of "
            "rank %d, which trained the most steps, are now every rank's",
            self.steps_shadowed,
            src,
        )

    def __enter__(self) -> Join:
        self._begin()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._shadowing(exc_type):
            try:
                while True:
                    self.sched.synchronize()
                    if self._shadowed():
                        break
            finally:
                self._end()

    async def __aenter__(self) -> Join:
        self._begin()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._shadowing(exc_type):
            try:
                while True:
                    await self.sched.wait()
                    if self._shadowed():
                        break
            finally:
                self._end()
