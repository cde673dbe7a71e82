"""Numbers read from environment variables, checked where they are read.

overlap reads a few tuning knobs from the environment at import (the spin windows of the
gloo and MPI completion paths, DeepSpeed's ``DEEPSPEED_TIMEOUT``). A bad value used to fail
``import overlap`` with Python's own ``could not convert string to float: 'abc'``, which
names neither the variable nor the fix; ``inf`` made a spin that never ends. Each knob is
read through :func:`number`, which names both.
"""

from __future__ import annotations

import math
import os

__all__ = ["number"]


def number(name: str, default: float, *, low: float, high: float, unit: str) -> float:
    """``float(os.environ[name])``, or ``default`` when unset or empty.

    Raises ValueError naming the variable, its value, the allowed range and the fix when the
    value is not a finite number within ``[low, high]``.
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and low <= value <= high):
        raise ValueError(
            f"environment variable {name}={raw!r} is not a number of {unit} from {low:g} to "
            f"{high:g}: set it to one (the default is {default:g}) or unset it"
        )
    return value
