"""Numbers and switches read from environment variables, checked where they are read.

overlap reads a few tuning knobs from the environment at import (the spin windows of the
gloo and MPI completion paths, DeepSpeed's ``DEEPSPEED_TIMEOUT``). A bad value used to fail
``import overlap`` with Python's own ``could not convert string to float: 'abc'``, which
names neither the variable nor the fix; ``inf`` made a spin that never ends. Each knob is
read through :func:`number`, which names both.

The on/off variables (``OVERLAP_DEBUG``, ``OVERLAP_NUMBA``, ``OVERLAP_MPI_CUDA_AWARE``) were
each read their own way: ``OVERLAP_MPI_CUDA_AWARE=true`` (or ``yes``) was taken as off, and
``OVERLAP_DEBUG=no`` as on, silently. :func:`switch` reads them alike and refuses a value it
cannot read, naming the variable and the words it takes.
"""

from __future__ import annotations

import math
import os

__all__ = ["number", "switch"]


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


_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def switch(name: str, default: bool) -> bool:
    """``os.environ[name]`` as on/off (1/true/yes/on, 0/false/no/off, any case), or
    ``default`` when unset or empty. Raises ValueError naming the variable otherwise."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if raw.lower() in _ON:
        return True
    if raw.lower() in _OFF:
        return False
    raise ValueError(
        f"environment variable {name}={raw!r} is not on or off: set it to 1 (or true, yes, "
        f"on) or 0 (or false, no, off), or unset it (the default is {int(default)})"
    )
