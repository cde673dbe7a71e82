"""Checks of the numbers the public constructors take, so that a typo fails where it is
made, naming the argument, and not steps later inside a reduction on a worker thread.

Found by trying: ``PowerSGD(rank=1.5)`` was taken and failed in its first compressed step
(``torch.randn`` of a float size, on the worker, which stops the scheduler);
``PowerSGD(min_compression_rate=nan)`` silently never compressed; ``OneBit(warmup_steps=
"2")`` raised a comparison's TypeError; ``BucketScheduler(bucket_cap_mb=nan)`` int()'s
"cannot convert float NaN to integer".
"""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["count", "positive_real"]


def count(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int of at least ``minimum`` (numpy's ints too; bools are not);
    TypeError for another type, ValueError below ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def positive_real(name: str, value: Any, *, zero: bool = False) -> float:
    """``value`` as a finite float above 0 (at 0 or above with ``zero``); TypeError for
    something that is not a real number, ValueError for NaN, inf or out of range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (v == 0 and not zero):
        low = ">= 0" if zero else "> 0"
        raise ValueError(f"{name} must be a finite number {low}, got {value!r}")
    return v
