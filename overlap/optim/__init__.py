"""Optimizers that communicate: DeepSpeed's 1-bit Adam, standalone or overlapped with
backward by a BucketScheduler."""

from __future__ import annotations

from overlap.optim.onebit_adam import OneBitAdam

__all__ = ["OneBitAdam"]
