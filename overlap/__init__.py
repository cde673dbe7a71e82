"""overlap: awaitable distributed communication for PyTorch, hidden behind computation.

The public surface. ``from overlap import comm`` gives the deepspeed.comm-style API; the
names used most are re-exported here.
"""

from __future__ import annotations

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
