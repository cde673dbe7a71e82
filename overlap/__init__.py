"""overlap: awaitable distributed communication for PyTorch, hidden behind computation.

The public surface. ``from overlap import comm`` gives the deepspeed.comm-style API; the
names used most are re-exported here.

The names are loaded on first use (PEP 562): ``import overlap`` alone imports no torch, so
the ``overlap`` command answers ``--help`` at once and a Ctrl-C in its first second is
taken as any other (importing torch on every command start cost 1.5-2 s, and an interrupt
inside it printed the import's traceback; fifty-eighth session). ``overlap.X`` and
``from overlap import X`` give the same objects as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what static tools see; at run time each name comes from _WHERE
    from overlap import comm, compression
    from overlap.buffer_sync import sync_buffers
    from overlap.comm import Handle, ReduceOp, destroy_process_group, init_distributed
    from overlap.compression import (
        BF16,
        FP8,
        FP16,
        Auto,
        Int8,
        NoCompression,
        OneBit,
        PowerSGD,
    )
    from overlap.errors import (
        CollectiveMismatchError,
        CommError,
        CommTimeoutError,
        IncompleteBackwardError,
        InFlightWriteError,
        MessageMismatchError,
        NonFiniteError,
        NotInitializedError,
        OutOfStepError,
        OverlapError,
        RankError,
    )
    from overlap.optim import DiLoCo, OneBitAdam
    from overlap.ownership import holder as holder_of
    from overlap.runtime import new_event_loop, run
    from overlap.scheduler import BucketScheduler
    from overlap.state_broadcast import broadcast_optimizer_state, broadcast_parameters
    from overlap.trace import OverlapReport, Tracer

__version__ = "0.1.0"

_ERRORS = (
    "CollectiveMismatchError CommError CommTimeoutError IncompleteBackwardError "
    "InFlightWriteError MessageMismatchError NonFiniteError NotInitializedError "
    "OutOfStepError OverlapError RankError"
)
# each public name: (the module it comes from, its name there); a module itself when None.
# tests/unit/test_package.py checks this table against the TYPE_CHECKING imports above.
_WHERE: dict[str, tuple[str, str | None]] = {
    "comm": ("overlap.comm", None),
    "compression": ("overlap.compression", None),
    "sync_buffers": ("overlap.buffer_sync", "sync_buffers"),
    **{n: ("overlap.comm", n) for n in ("Handle", "ReduceOp")},
    **{n: ("overlap.comm", n) for n in ("destroy_process_group", "init_distributed")},
    **{
        n: ("overlap.compression", n)
        for n in ("BF16", "FP8", "FP16", "Auto", "Int8", "NoCompression", "OneBit", "PowerSGD")
    },
    **{n: ("overlap.errors", n) for n in _ERRORS.split()},
    **{n: ("overlap.optim", n) for n in ("DiLoCo", "OneBitAdam")},
    "holder_of": ("overlap.ownership", "holder"),
    **{n: ("overlap.runtime", n) for n in ("new_event_loop", "run")},
    "BucketScheduler": ("overlap.scheduler", "BucketScheduler"),
    **{
        n: ("overlap.state_broadcast", n)
        for n in ("broadcast_optimizer_state", "broadcast_parameters")
    },
    **{n: ("overlap.trace", n) for n in ("OverlapReport", "Tracer")},
}


def __getattr__(name: str) -> Any:
    """Load public name ``name`` on first use, and keep it (the next use is a plain global)."""
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'overlap' has no attribute {name!r}")
    module = importlib.import_module(where[0])
    value = module if where[1] is None else getattr(module, where[1])
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


__all__ = [
    "Auto",
    "BF16",
    "BucketScheduler",
    "FP16",
    "CollectiveMismatchError",
    "CommError",
    "CommTimeoutError",
    "DiLoCo",
    "FP8",
    "Handle",
    "IncompleteBackwardError",
    "InFlightWriteError",
    "Int8",
    "MessageMismatchError",
    "NoCompression",
    "NonFiniteError",
    "NotInitializedError",
    "OneBit",
    "OneBitAdam",
    "OverlapReport",
    "OutOfStepError",
    "OverlapError",
    "PowerSGD",
    "RankError",
    "Tracer",
    "ReduceOp",
    "__version__",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "comm",
    "compression",
    "destroy_process_group",
    "holder_of",
    "init_distributed",
    "new_event_loop",
    "run",
    "sync_buffers",
]
