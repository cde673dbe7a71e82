"""The exceptions overlap raises.

Every exception the library defines derives from :class:`OverlapError`, so one ``except``
catches them all. Bad arguments raise the built-in ``ValueError`` / ``TypeError`` (the
messages name the fix); the classes here are for states and failures that a caller may want
to handle on purpose.
"""

from __future__ import annotations

__all__ = [
    "CollectiveMismatchError",
    "CommError",
    "CommTimeoutError",
    "IncompleteBackwardError",
    "MessageMismatchError",
    "NonFiniteError",
    "NotInitializedError",
    "OutOfStepError",
    "OverlapError",
    "RankError",
]


class OverlapError(Exception):
    """Root of every exception defined by overlap."""


class NotInitializedError(OverlapError, RuntimeError):
    """A communication call was made before :func:`overlap.init_distributed`."""


class CommError(OverlapError, RuntimeError):
    """A communication operation failed in the backend.

    The backend's own exception (for example torch's ``DistBackendError``) is kept as
    ``__cause__`` so nothing is lost when the error crosses a thread or an event loop.
    """


class CommTimeoutError(CommError, TimeoutError):
    """Waiting for an operation took longer than the caller allowed.

    Only the *wait* timed out: the operation itself is still in flight and still owns its
    tensors (see :class:`overlap.comm.Handle`).
    """


class RankError(OverlapError):
    """A rank started by :mod:`overlap.testing` died or hung instead of returning."""


class NonFiniteError(OverlapError, FloatingPointError):
    """A compressed reduction saw NaN or Inf in its input on some rank.

    Raised on every rank alike (the ranks learn it from the exchanged scales, with no extra
    collective), before any error-feedback state is touched (each compressor's docstring
    says what its buffer then holds). ``ranks`` lists the ranks whose input was not finite,
    where the compressor can tell (empty otherwise). A compressor built with
    ``on_nonfinite="skip"`` raises nothing: its result is NaN on every rank
    (:mod:`overlap.compression.nonfinite`).
    """

    def __init__(self, message: str, ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.ranks = list(ranks or [])


class IncompleteBackwardError(OverlapError, RuntimeError):
    """A BucketScheduler step ended after a backward that raised before it finished.

    A backward that raises halfway (an out-of-memory error, a bug in one rank's loss) has
    already handed some gradients to the scheduler, and may have sent some buckets; its
    peers' backwards sent all of theirs. Ending the step (``synchronize()`` or ``await
    wait()`` on the rank that failed, after catching its error) keeps every rank in step:
    the rest of the buckets are sent (zeros where that rank has no gradient) and every rank
    then raises this error, with no gradient written back, instead of returning an average
    that mixes one rank's partial gradient in. The scheduler is ready for the next step;
    ``.grad`` of the failed step is undefined (zero it and skip ``optimizer.step()``).
    ``ranks`` lists the ranks whose backward did not finish.
    """

    def __init__(self, message: str, ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.ranks = list(ranks or [])


class CollectiveMismatchError(CommError):
    """Debug mode found ranks about to issue different collectives (op, shapes or order).

    ``ranks`` lists the ranks that differ from the group's first rank.
    """

    def __init__(self, message: str, ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.ranks = list(ranks or [])


class MessageMismatchError(CommError):
    """A received message does not fit its receive: the sender's tensor had another size
    (or, in debug mode, another dtype) than the receiving tensor.

    Raised where the receive is awaited or waited, on the receiving rank. MPI reports the
    received byte count, so there it is always checked (a larger receive was partly
    filled: MPI wrote the message's bytes and left the rest). gloo reports nothing, so
    there it is checked in debug mode, which sends a small header before each message and
    lands a mismatched message in a scratch buffer: the receiving tensor is left as it was.
    ``ranks`` is ``[sender, receiver]`` (global ranks).
    """

    def __init__(self, message: str, ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.ranks = list(ranks or [])


class InFlightWriteError(CommError):
    """Debug mode saw a tensor written in place while an async op on it was in flight.

    ``h = comm.all_reduce(t, async_op=True); t.mul_(2); h.wait()``: the backend reads and
    writes ``t`` until the op completes, so what lands in ``t`` (or what a send delivers) is
    some mix of the write and the op, and may differ from rank to rank. Raised where the op
    is waited or awaited, on the rank that wrote; the op itself completed on every rank, so
    the group stays in step. Found through the tensor's version counter, which every
    in-place torch op on it or on any view of it moves (a write through ``.data`` or a NumPy
    array of it does not, and goes unseen). Only a tensor that is not itself a view is
    checked: a write to another part of a view's base is not a race.
    """


class OutOfStepError(CommError):
    """A BucketScheduler stopped issuing collectives, because its ranks' no longer match.

    A bucket's reduction failed on this rank with an error of its own (a bug in a user's
    compressor on one rank, a local OS error): this rank issued fewer collectives than its
    peers, and any further one would pair with a different op on them (data summed across
    the wrong buckets and returned as a result, or a size mismatch that aborts the
    process). Or a collective of the scheduler failed (a peer stopped, was lost or timed
    out): the peers may never issue the rest. So the scheduler issues nothing more: the
    step where it happens raises the error that stopped it, and every later step on that
    rank raises this error before anything is sent. A peer still in step waits for the
    stopped rank's collectives until the backend's timeout, gets a CommError, and stops the
    same way: every rank raises within the timeout, none hangs, none returns a wrong
    gradient. The parameters are untouched; ``.grad`` of the failed step is undefined. To go
    on, make new process groups and a new scheduler (e.g. restart from a checkpoint).
    """
