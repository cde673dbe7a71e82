"""Optimizers that communicate: DeepSpeed's 1-bit Adam, standalone or overlapped with
backward by a BucketScheduler, and DiLoCo's infrequent outer synchronisation."""

from __future__ import annotations

from overlap.optim.diloco import DiLoCo
from overlap.optim.onebit_adam import OneBitAdam

__all__ = ["DiLoCo", "OneBitAdam"]
