"""``sendrecv``: send one tensor and receive another in one call, as ``MPI_Sendrecv`` does.

A ring step, a halo exchange or a pipeline stage's "send forward, receive from behind" is
a receive and a send that belong together. Written as ``irecv`` + ``isend`` and a wait
on each, that is four calls, two Handles and two completions; the backends' own pair
(mpi4py's ``Irecv`` + ``Isend`` + ``Waitall``, torch's ``irecv`` + ``isend`` + waits)
costs less than that, and on an 8-byte MPI exchange overlap's four calls cost 3.7x
mpi4py's (docs/architecture.md, "The floor of a Python handle"). One call makes one
check of the pair and, when the same tensors are exchanged with the same peers again,
posts both straight to the backend and waits on both at once (each backend's
``sendrecv``). Everything else (a tracer attached, debug mode's framed messages, CUDA
tensors, a receive from any rank) is this module's :func:`composed` form: the backend's
own ``irecv`` and ``isend``, finished together.

Contract (both forms, both backends):

* the receive is posted first, then the send, with one ``tag`` for both;
* the blocking form returns ``recv_tensor`` once both are over; ``async_op=True`` returns
  one Handle that resolves to ``recv_tensor`` once both are over, with ``source`` the
  sender's global rank, and owns both tensors until then;
* every argument is checked before anything is posted, so a refused call leaves no
  receive posted that would take a later message;
* a send whose memory overlaps the receive's is sent from a copy taken at the call
  (``MPI_Sendrecv_replace``'s meaning): ``sendrecv(t, dst, t, src)`` shifts ``t`` round a
  ring.
"""

from __future__ import annotations

from typing import Any

from overlap.comm.collect import _Collected
from overlap.comm.handle import Handle

__all__ = ["PairWork", "composed"]


class _Pair(_Collected):
    """The Handle of a composed sendrecv: done when its receive and its send are; its result
    is the received tensor and its ``source`` the receive's. Not traced (its two ops are)."""

    __slots__ = ("recv",)
    recv: Any  # the caller's receive tensor: the result

    def _results(self) -> Any:
        return self.recv


def composed(backend: Any, send: Any, dst: int, recv: Any, src: Any, group: Any, tag: int,
             async_op: bool) -> Any:  # fmt: skip
    """The sendrecv as the backend's own ``irecv`` and ``isend`` (already checked by the
    caller: nothing here refuses an argument after the receive is posted). ``recv`` is the
    caller's own tensor, which the call returns (a backend's receive of a tensor that
    requires grad works on a detached view of it)."""
    hr: Handle = backend.irecv(recv, src, group, tag)
    hs: Handle = backend.isend(send, dst, group, tag)
    if not async_op:
        hr.wait()
        hs.wait()
        return recv
    pair = _Pair([hr, hs], hr.nbytes, hr.group, hr.backend, hr.world)
    pair.op = "sendrecv"
    pair.recv = recv
    pair._source = lambda: hr.source
    return pair


class PairWork:
    """A gloo receive's Work and a send's as one Work for one Handle's engine
    (:class:`~overlap.comm.waiters.TorchOp`): one waiter thread waits the receive, then
    the send. gloo's point-to-point Works have no future, so an awaited op needs a thread
    in its ``wait()``; two Handles needed two (docs/architecture.md, "An awaited pair's
    hand-offs together": one thread waiting both in order was the cheaper form)."""

    __slots__ = ("recv", "send")

    def __init__(self, recv: Any, send: Any) -> None:
        self.recv, self.send = recv, send

    def wait(self, timeout: Any = None) -> bool:
        self.recv.wait()
        self.send.wait()
        return True

    def is_completed(self) -> bool:
        return bool(self.recv.is_completed()) and bool(self.send.is_completed())

    def is_success(self) -> bool:
        return bool(self.recv.is_success()) and bool(self.send.is_success())
