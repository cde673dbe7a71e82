"""MpiRecv: a plain MPI receive, which reads its own Status when it completes.

A receive must note who sent the message (``irecv(src=None)`` takes one from any rank,
and ``Handle.source`` says which) and refuse a message shorter than the tensor (MPI writes
what came and leaves the rest). Done as two closures and a list made per receive, that cost
about 1.5 us of an 8-byte receive's 9 on the 2-core machine; as a method of the op itself,
nothing is made per receive but the op (docs/architecture.md, "Lean ops").

Debug mode's framed receives (overlap.comm.p2p_debug) keep a ``post`` of their own.
"""

from __future__ import annotations

from typing import Any, ClassVar

from overlap.comm.p2p import describe
from overlap.comm.progress import MpiOp
from overlap.errors import CommError, MessageMismatchError

__all__ = ["MpiRecv"]


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
        frm = self.ranks[src]
        self._source = frm
        got = status.Get_count(self.MPI.BYTE)
        if 0 <= got < self.nbytes:  # (MPI_UNDEFINED, negative, past 2**31 - 1 bytes: unchecked)
            me = self.rank
            self._fail(
                MessageMismatchError(
                    f"irecv on rank {me} (group {self.group}, tag {self.tag}) received {got} "
                    f"bytes from rank {frm} into a {self.nbytes}-byte tensor "
                    f"({describe(self._result)}): the sender's tensor is smaller. Send and "
                    f"receive tensors of the same size; MPI wrote the first {got} bytes and "
                    "left the rest as it was",
                    ranks=[frm, me],
                )
            )
            return
        MpiOp._complete(self, status)
