"""Timeouts as the public API takes them: seconds (any real number) or a timedelta.

Two kinds, checked in one place so every call says the same thing about a bad one:

* a **wait** (``Handle.wait(timeout)``): 0 polls, ``None`` or ``math.inf`` waits for ever.
  Before, ``inf`` raised an OverflowError from deep inside ("timestamp out of range for platform
  time_t"), NaN "Invalid value NaN", a string a comparison's TypeError, and -1 a
  CommTimeoutError saying the op "did not complete within -1 s";
* a **job or barrier timeout** (``init_distributed``, ``monitored_barrier``): positive and
  finite, since it becomes the backend's own deadline (gloo keeps milliseconds in an int).
"""

from __future__ import annotations

import datetime
import math
import numbers
from typing import Any

__all__ = ["positive_seconds", "wait_seconds"]


def _seconds(timeout: Any, what: str) -> float:
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"{what} takes seconds (a number) or a timedelta, got {timeout!r}")
    return float(timeout)


def wait_seconds(timeout: Any) -> float | None:
    """A wait's timeout in seconds, None to wait for ever (``None`` or +inf)."""
    if timeout is None:
        return None
    t = _seconds(timeout, "timeout")
    if math.isnan(t) or t < 0:
        raise ValueError(
            f"timeout must be 0 or more seconds (0 polls; None waits for ever), got {timeout!r}"
        )
    return None if math.isinf(t) else t


def positive_seconds(timeout: Any) -> float:
    """A job's or a barrier's timeout in seconds: positive and finite."""
    t = _seconds(timeout, "timeout")
    if not (math.isfinite(t) and t > 0):
        raise ValueError(
            f"timeout must be positive, finite seconds or a timedelta, got {timeout!r}"
        )
    return t
