"""The process's active communication backend (set by init_distributed)."""

from __future__ import annotations

import threading
from typing import Any

from overlap.errors import NotInitializedError

__all__ = ["active", "clear", "is_active", "set_active"]

_backend: Any = None
_local_rank = 0
_placement = (1, 0)  # (processes on this host, this host's index): see set_active
generation = 0  # bumped by every clear(): ops issued under an older one can never finish
_lock = threading.Lock()

_NOT_INIT = (
    "overlap.comm is not initialized: call overlap.init_distributed() first. It reads RANK, "
    "WORLD_SIZE, MASTER_ADDR and MASTER_PORT as set by torchrun, or discovers them under "
    "mpiexec, and runs as a single rank otherwise."
)


def active() -> Any:
    """The active backend, or NotInitializedError telling the user to call init_distributed."""
    b = _backend
    if b is None:
        raise NotInitializedError(_NOT_INIT)
    return b


def is_active() -> bool:
    return _backend is not None


def set_active(
    backend: Any, local_rank: int, local_world_size: int | None = None, node_rank: int = 0
) -> None:
    """Make ``backend`` active. ``local_world_size`` (processes on this host; None: the world
    size, one host) and ``node_rank`` (this host's index) come from the launcher."""
    global _backend, _local_rank, _placement
    with _lock:
        _backend = backend
        _local_rank = local_rank
        size = local_world_size if local_world_size is not None else backend.get_world_size()
        _placement = (int(size), int(node_rank))


def local_rank() -> int:
    active()
    return _local_rank


def local_world_size() -> int:
    active()
    return _placement[0]


def node_rank() -> int:
    active()
    return _placement[1]


def clear() -> Any:
    global _backend, _local_rank, generation, _placement
    with _lock:
        b, _backend, _local_rank = _backend, None, 0
        _placement = (1, 0)
        generation += 1
    return b
