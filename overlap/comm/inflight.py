"""Handles being observed asynchronously, so that leaving the job can fail them.

A torch op handed to a completion engine (the waiter pool or a gloo future callback) is
tracked here until it completes. (MPI ops are not: failing one early would release buffers
MPI may still write into; they keep the job timeout's expiry instead.) ``destroy_process_group()``
fails whatever is still tracked with :class:`~overlap.errors.CommError`, so an awaiter or a
``wait()`` on such a handle wakes with an error instead of waiting for an op that can no
longer complete (its process group is gone). Tracking costs one dict insert and one pop per
asynchronously observed op.
"""

from __future__ import annotations

from typing import Any

from overlap.errors import CommError

__all__ = ["busy", "fail_all", "track", "untrack"]

_handles: dict[int, Any] = {}  # dict operations are atomic under the GIL: no lock


def track(handle: Any) -> None:
    _handles[id(handle)] = handle


def untrack(handle: Any) -> None:
    _handles.pop(id(handle), None)


def busy() -> bool:
    """Whether any op of this process is being observed asynchronously right now."""
    return bool(_handles)


def fail_all() -> int:
    """Fail every tracked handle with CommError; returns how many were failed."""
    failed = 0
    while _handles:
        try:
            _, h = _handles.popitem()
        except KeyError:  # completed (untracked) meanwhile
            break
        h._finish(destroyed_error(h))
        failed += 1
    return failed


def destroyed_error(handle: Any) -> CommError:
    return CommError(
        f"{handle.op} (group {handle.group}) was still in flight when the process group was "
        "destroyed (destroy_process_group()); it can no longer complete. Wait for or await "
        "every handle before destroying the group"
    )
