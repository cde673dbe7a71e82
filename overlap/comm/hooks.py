"""The comm layer's one observer hook: how a tracer hears about finished ops.

Every op, blocking or not, reports ``(op, start_ns, end_ns, nbytes, group, backend, world)``
to the observer when it finishes, if one is set. With none set (the default) the whole cost
is one module attribute read per op. The Tracer registers itself here on ``attach()``; comm
never imports the trace package, so trace's cross-rank export may import comm freely (this
module broke an import cycle between the two, and took the tracer lookup off the hot path).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Observer", "observer", "set_observer"]

Observer = Callable[[str, int, int, int, str, str, int], None]

observer: Observer | None = None


def set_observer(fn: Observer | None) -> Observer | None:
    """Install ``fn`` (None removes it); returns the previous observer."""
    global observer
    previous, observer = observer, fn
    return previous
