"""Debug mode's check that nobody wrote an async op's tensors while the op was in flight.

``h = comm.all_reduce(t, async_op=True); t.mul_(2); h.wait()`` is a race that torch and
DeepSpeed leave silent: the backend reads and writes ``t`` until the op completes, so ``t``
ends as some mix of the write and the reduction, and the ranks may disagree. In debug mode
each backend's ``_launch`` wraps an async op's post-processing in :func:`guard`: the
version counter of every tensor the op writes or sends is read right after the post, and
read again when the op has completed, before overlap's own post-processing (an average's
division, a copy back from a staging buffer) moves it. A change fails the handle with
:class:`~overlap.errors.InFlightWriteError`, raised where it is waited or awaited. The op
itself ran to completion on every rank, so the group stays in step.

A tensor is checked only when it is not a view. Views share their base's version counter,
so a write to another part of the base (a bucket next to the one in flight, a gradient
written into a flat buffer) would move it too, and that is no race; the op's whole tensor
is in the op, so for a tensor that is not a view any in-place write to it or to any view of
it is one. Writes that bypass the counter (``t.data``, a NumPy array of ``t``) go unseen.

Which ops: every op on MPI, which writes through NumPy views of the tensors and runs
overlap's own staging copies only once the op is complete (the differential fuzz of
tests/gloo/differential_cases.py, 4 seeds x 300 ops on 3 ranks in debug mode, flagged
nothing). On gloo, only :data:`RAW_ON_GLOO`: gloo writes their tensors through raw
pointers. Its all_gather, gather, all_gather_into_tensor and reduce_scatter copy the
result into the output with torch ops on gloo's own thread, which move the counter while
the op runs: the same fuzz flagged each of them with no write by anyone, so they are not
checked. NCCL is not checked (not yet run on a GPU with this check).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from overlap.errors import InFlightWriteError

__all__ = ["RAW_ON_GLOO", "guard", "snapshot"]

RAW_ON_GLOO = frozenset(
    {"all_reduce", "broadcast", "reduce", "isend", "irecv", "all_to_all_single", "all_to_all",
     "scatter"}
)  # fmt: skip


def _watched(result: Any) -> list[tuple[int, torch.Tensor, int]]:
    """(position, tensor, version) of each tensor of ``result`` that is not a view."""
    items = result if isinstance(result, (list, tuple)) else [result]
    return [
        (i, t, t._version)
        for i, t in enumerate(items)
        if isinstance(t, torch.Tensor) and t._base is None
    ]


def snapshot(opname: str, rank: int, result: Any) -> Callable[[], InFlightWriteError | None]:
    """A check, to call once the op is complete: the error to fail it with if ``result``'s
    tensors were written since now, else None."""
    return _checker(opname, rank, result, _watched(result))


def _checker(
    opname: str, rank: int, result: Any, watched: list[tuple[int, torch.Tensor, int]]
) -> Callable[[], InFlightWriteError | None]:
    listed = isinstance(result, (list, tuple))

    def written() -> InFlightWriteError | None:
        for i, t, version in watched:
            if t._version != version:
                which = f"tensor {i} of its list" if listed else "its tensor"
                return InFlightWriteError(
                    f"{opname} on rank {rank}: {which} ({tuple(t.shape)}, {t.dtype}) was "
                    "written in place while the op was in flight, so its result is a mix of "
                    "the write and the op and may differ between ranks. Wait for the handle "
                    "(h.wait() or await h) before writing the tensor, or write a copy"
                )
        return None

    return written


def guard(
    opname: str, rank: int, result: Any, post: Callable[..., Any] | None
) -> Callable[..., Any] | None:
    """``post`` preceded by :func:`snapshot`'s check, which raises the error; ``post``
    itself (None stays None) when there is no tensor to check."""
    watched = _watched(result)
    if not watched:
        return post
    written = _checker(opname, rank, result, watched)

    def checked(*args: Any) -> Any:
        err = written()
        if err is not None:
            raise err
        return None if post is None else post(*args)

    return checked
