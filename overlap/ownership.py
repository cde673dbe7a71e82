"""Which object (a BucketScheduler, a DiLoCo) holds a parameter or a compressor.

A parameter's gradient hooks, and a compressor's per-bucket state, belong to at most one
holder: two schedulers over one model would reduce every gradient twice, and a DiLoCo over a
model a BucketScheduler also reduces over the same ranks would average it twice over.
Holders :func:`claim` what they use when they are built and :func:`release` it when they are
removed; a second claim on a held object is refused with the holder's name.

One composition is allowed, and is why a parameter's holders stack: a DiLoCo over the
parameters a BucketScheduler averages inside each DiLoCo worker (the scheduler over the
worker's ranks, the DiLoCo one rank per worker: the two groups meet only in this rank).
The DiLoCo then holds them on top of the scheduler (:func:`holder_of` names the last
holder), and its removal gives them back to the scheduler.

Keyed by id() with a weak reference to the object itself (tensors compare elementwise, so
they cannot be dict keys), so a recycled id is never mistaken for a held object.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

__all__ = ["claim", "holder", "holder_of", "release"]

# id(obj) -> (a weak reference to obj, its holders, the first claim first)
_HELD: dict[int, tuple[weakref.ref[Any], list[Any]]] = {}


def _holders(obj: Any) -> list[Any] | None:
    entry = _HELD.get(id(obj))
    return entry[1] if entry is not None and entry[0]() is obj else None


def holder_of(obj: Any) -> Any | None:
    """The live holder of ``obj`` (the last one to claim it), or None."""
    hs = _holders(obj)
    return hs[-1] if hs else None


def claim(objs: Iterable[Any], holder: Any) -> None:
    """Record ``holder`` as a holder of each of ``objs``, on top of any other (the caller
    has checked that the two may share it)."""
    for obj in objs:
        hs = _holders(obj)
        if hs is None:
            _HELD[id(obj)] = (weakref.ref(obj), [holder])
        elif not any(h is holder for h in hs):
            hs.append(holder)


def release(objs: Iterable[Any], holder: Any) -> None:
    """Forget ``holder``'s claims on ``objs`` (others' claims are kept)."""
    for obj in objs:
        hs = _holders(obj)
        if hs is None:
            continue
        hs[:] = [h for h in hs if h is not holder]
        if not hs:
            del _HELD[id(obj)]


def holder(obj: Any) -> Any | None:
    """The BucketScheduler or DiLoCo that holds ``obj``, or None: public as
    ``overlap.holder_of``.

    ``obj`` is a model (``torch.nn.Module``: the holder of any of its parameters), a
    parameter, a compressor, or a OneBitAdam (the scheduler that reduces it). Made for the
    holder a caller lost without ``remove()``: one built in a function that raised, or in a
    notebook cell that ran again. Its hooks keep it alive and its parameters claimed, so a
    new scheduler over them is refused; ``overlap.holder_of(model).remove()`` frees them."""
    import torch

    if isinstance(obj, torch.nn.Module):
        return next((h for p in obj.parameters() if (h := holder_of(p)) is not None), None)
    found = holder_of(obj)
    if found is None and isinstance(obj, torch.optim.Optimizer):
        found = getattr(obj, "_sched", None)  # a OneBitAdam's scheduler
    return found
