"""MpiRecv: a plain MPI receive, which reads its own Status when it completes.

A receive must note who sent the message (``irecv(src=None)`` takes one from any rank,
and ``Handle.source`` says which) and refuse a message shorter than the tensor (MPI writes
what came and leaves the rest). Done as two closures and a list made per receive, that cost
about 1.5 us of an 8-byte receive's 9 on the 2-core machine; as a method of the op itself,
nothing is made per receive but the op (docs/architecture.md, "Lean ops").

Debug mode's framed receives (overlap.comm.p2p_debug) keep a ``post`` of their own.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

from overlap.comm.handle import PENDING
from overlap.comm.p2p import describe
from overlap.comm.progress import MpiOp, _graveyard
from overlap.errors import CommError, MessageMismatchError

__all__ = ["MpiPair", "MpiRecv", "keep_if_in_flight", "size_error"]


class MpiRecv(MpiOp):
    """An ``MPI_Irecv`` into the tensor's host buffer; ``post`` (if any) copies a staged
    CUDA receive back, and runs only once the message is known to fit."""

    __slots__ = ("ranks", "tag")

    reads_status: ClassVar[bool] = True

    # Set by the backend right after construction (MpiOp's own __init__, one call frame
    # fewer per receive): the group's global ranks (group rank -> global rank), the tag.
    ranks: tuple[int, ...]
    tag: int

    def _complete(self, status: Any) -> None:
        src = -1 if status is None else status.Get_source()
        if src < 0:
            # MPI completed the receive, and a KeyboardInterrupt raised between that and
            # this completion left no filled Status (every test overlap makes keeps its
            # Status on the op first; a Test made outside overlap does not): an empty one
            # says MPI_ANY_SOURCE and 0 bytes, which read as a sender would name the wrong
            # rank, and as a size a false mismatch.
            self._fail(
                CommError(
                    f"irecv on rank {self.rank} (group {self.group}, tag {self.tag}) "
                    "completed, but its sender and size were lost: a KeyboardInterrupt was "
                    "raised between MPI's completion of the receive and overlap's. The tensor "
                    "holds the message as MPI wrote it; receive again to know its sender"
                )
            )
            return
        self._source = self.ranks[src]
        err = size_error(
            self.op, self.rank, self.group, self.tag, status, self.MPI.BYTE, self._result,
            self.ranks,
        )  # fmt: skip
        if err is not None:
            self._fail(err)
            return
        MpiOp._complete(self, status)


def size_error(
    op: str, me: int, group: str, tag: int, status: Any, byte: Any, t: Any, ranks: Any
) -> MessageMismatchError | None:
    """None when the receive into ``t`` that ``status`` describes got all of ``t``'s bytes;
    else the error naming the sender (``ranks``: group rank -> global rank) and both sizes.
    A count MPI cannot give (MPI_UNDEFINED, negative, past 2**31 - 1 bytes) is not checked.
    The one place of this rule for every MPI receive: an ``irecv``'s completion, and the
    blocking ``recv`` and ``sendrecv`` that wait without a Handle."""
    got = status.Get_count(byte)
    if not 0 <= got < t.nbytes:
        return None
    frm = ranks[status.Get_source()]
    return MessageMismatchError(
        f"{op} on rank {me} (group {group}, tag {tag}) received {got} bytes from rank {frm} "
        f"into a {t.nbytes}-byte tensor ({describe(t)}): the sender's tensor is smaller. "
        f"Send and receive tensors of the same size; MPI wrote the first {got} bytes and left "
        "the rest as it was",
        ranks=[frm, me],
    )


def keep_if_in_flight(req: Any, keep: Any) -> None:
    """Keep ``req`` and the tensors ``keep`` for good (the graveyard of expired ops, never
    freed under MPI) unless one ``Test`` finds it over, either way: MPI may still read a
    send's buffer after the op it belonged to has failed."""
    if not req:
        return
    try:
        over = req.Test()
    except Exception:
        over = True
    if not over:
        _graveyard.append((req, keep))


class MpiPair(MpiRecv):
    """A sendrecv's two requests behind one Handle: the receive's (``req`` at first), then
    the send's (``sreq``). The op is over when both are.

    The progress engine, ``spin`` and MPI's Wait handle one request per op, so the pair
    completes in two stages through them: when the receive's request completes, its
    Status is kept (``rstatus``) and the send's request becomes ``req``; if that one is
    over already (a small message leaves at its post), the op finishes at once, else it
    stays pending and whoever tests or waits on it next tests or waits on the send. The
    receive's checks (its sender, a short message) are made at the end, so a failed pair
    still owns both tensors until MPI is done with both. ``_open`` counts the pair once.

    Every stage reads its place from the requests themselves (``req is sreq``, a request
    MPI has freed is false), so a signal raised between two lines here leaves a state the
    next test or wait carries on from."""

    __slots__ = ("rstatus", "sreq")

    # Set by the backend right after construction (MpiOp's own __init__, no frame more),
    # with ranks and tag: the send's request, and None.
    sreq: Any
    rstatus: Any

    def _complete(self, status: Any) -> None:
        sreq = self.sreq
        if self.req is not sreq:  # the receive is over: keep its Status, go on to the send
            self.rstatus = status
            self.req = sreq
        if sreq:  # not yet freed by MPI: the send may still be in flight
            try:
                if not sreq.Test():
                    return  # pending: the next test or wait is on the send
            except Exception as exc:
                self._fail(exc)
                return
        MpiRecv._complete(self, self.rstatus)

    def spin(self, seconds: float) -> bool:
        """:meth:`MpiOp.spin` over both stages, in one window."""
        clock = time.perf_counter
        end = clock() + seconds
        while MpiOp.spin(self, max(end - clock(), 0.0)):
            if self._state is not PENDING:
                return True
            # the receive completed in that spin and the send is pending: spin on it
        return False

    def _wait_forever(self) -> None:
        while self._state is PENDING:
            MpiOp._wait_forever(self)

    def _fail(self, exc: BaseException) -> None:
        if self.req is not self.sreq:  # the receive failed: the send may be in flight
            keep_if_in_flight(self.sreq, self._keep)
        MpiOp._fail(self, exc)

    def expire(self) -> None:
        if self.req is not self.sreq:
            _graveyard.append(self.sreq)  # MPI may still read the send's buffer too
        MpiOp.expire(self)
