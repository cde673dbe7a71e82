"""Which object (a BucketScheduler, a DiLoCo) holds a parameter or a compressor.

A parameter's gradient hooks, and a compressor's per-bucket state, belong to at most one
holder: two schedulers over one model would reduce every gradient twice, and a DiLoCo over a
model a BucketScheduler also reduces would average it twice over. Holders :func:`claim`
what they use when they are built and :func:`release` it when they are removed; a second
claim on a held object is refused with the holder's name.

Keyed by id() with a weak reference to the object itself (tensors compare elementwise, so
they cannot be dict keys), so a recycled id is never mistaken for a held object.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

__all__ = ["claim", "holder_of", "release"]

_HELD: dict[int, tuple[weakref.ref[Any], Any]] = {}


def holder_of(obj: Any) -> Any | None:
    """The live holder of ``obj``, or None."""
    entry = _HELD.get(id(obj))
    return entry[1] if entry is not None and entry[0]() is obj else None


def claim(objs: Iterable[Any], holder: Any) -> None:
    """Record ``holder`` as the holder of each of ``objs`` (the caller has checked)."""
    for obj in objs:
        _HELD[id(obj)] = (weakref.ref(obj), holder)


def release(objs: Iterable[Any], holder: Any) -> None:
    """Forget ``holder``'s claims on ``objs`` (others' claims are kept)."""
    for obj in objs:
        if holder_of(obj) is holder:
            del _HELD[id(obj)]
