"""Handles being observed asynchronously, so that leaving the job can fail them.

An op handed to a completion engine (the waiter pool, a gloo future callback, the MPI
progress engine or reaper) is tracked here until it completes. ``destroy_process_group()``
fails whatever is still tracked with :class:`~overlap.errors.CommError`, so an awaiter or a
``wait()`` on such a handle wakes with an error instead of waiting for an op that can no
longer complete (its process group is gone). Tracking costs one dict insert and one pop per
asynchronously observed op.
"""

from __future__ import annotations

import threading
from typing import Any

from overlap.errors import CommError

__all__ = ["fail_all", "track", "untrack"]

_handles: dict[int, Any] = {}
_lock = threading.Lock()


def track(handle: Any) -> None:
    _handles[id(handle)] = handle


def untrack(handle: Any) -> None:
    _handles.pop(id(handle), None)


def fail_all() -> int:
    """Fail every tracked handle with CommError; returns how many were failed."""
    with _lock:
        handles = list(_handles.values())
        _handles.clear()
    for h in handles:
        h._finish(destroyed_error(h))
    return len(handles)


def destroyed_error(handle: Any) -> CommError:
    return CommError(
        f"{handle.op} (group {handle.group}) was still in flight when the process group was "
        "destroyed (destroy_process_group()); it can no longer complete. Wait for or await "
        "every handle before destroying the group"
    )
