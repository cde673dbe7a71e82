"""Late landings: streaming DiLoCo reductions that do not arrive within their delay.

A streaming fragment's reduction is meant to run in the background and be there when it
lands, ``delay`` inner steps after its issue. When the link cannot carry the schedule (each
rank sends ``steady_bytes_per_step`` a step on average, and a slower link takes longer than
a step to carry that) or one rank is behind the others, every landing waits for its
reduction: streaming quietly becomes plain DiLoCo's stall, spread over the steps.
``statistics()["wait_s"]`` counts those waits for a user who looks; this watch says it in
the log once, with the fix (measured: at 100 Mbit/s and 40 ms steps, H = 8 needs 184 Mbit/s,
and the bench's slowest step was 7x compute-only's; docs/diloco.md, "Speed").

It looks at windows of one landing per fragment (a whole cycle of H steps): one landing's
wait is weighed against the time of the whole cycle it falls in, and the steps before the
first landing count in the first window.
"""

from __future__ import annotations

from dataclasses import dataclass

# The share of a window's wall time spent waiting at landings that makes it late: streaming's
# goal is a step at most 1.05x compute-only's at the median, and a tenth of the time waiting
# is past any noise a reduction's own completion has (its callback, the waiter's hand-off).
LATE_SHARE = 0.1
# ...and the least wait in seconds that does: a model of a few thousand weights whose steps
# take 2 ms waits half of its time for reductions that take 1 ms on loopback (measured:
# examples/diloco.py, 9 ms of waiting in a 17 ms cycle), which no H or delay changes and no
# run notices; a cycle that loses a tenth of a second does.
LATE_FLOOR_S = 0.1


@dataclass
class Late:
    """One window that was late: the seconds waited at its landings, its wall-clock
    seconds, and the inner steps it spans."""

    waited_s: float
    wall_s: float
    steps: int


class LateLandings:
    """Counts the waits at landings against the wall time of the inner steps around them,
    window by window; says so once, the first time a window is late: it waited more than
    ``share`` of its wall time, and at least ``floor_s`` seconds.

    The caller calls :meth:`step` at every inner step (``DiLoCo.step()``/``astep()``) and
    :meth:`landed` after each landing of those calls (not ``flush()``'s or ``finish()``'s:
    waiting there is what they are for)."""

    def __init__(
        self, per_window: int, share: float = LATE_SHARE, floor_s: float = LATE_FLOOR_S
    ) -> None:
        self.per_window = per_window
        self.share = share
        self.floor_s = floor_s
        self.said = False
        self._start: float | None = None
        self._steps = 0
        self._landings = 0
        self._waited = 0.0

    def step(self, now: float) -> None:
        """One inner step begins at ``now`` (perf_counter seconds)."""
        if self._start is None:
            self._start = now
        self._steps += 1

    def landed(self, waited_s: float, now: float) -> Late | None:
        """A landing waited ``waited_s`` for its reduction; at the end of a window, that
        window when it was late and nothing has been said yet, else None."""
        if self._start is None:  # no step counted: nothing to weigh the wait by
            return None
        self._landings += 1
        self._waited += waited_s
        if self._landings < self.per_window:
            return None
        late = Late(self._waited, now - self._start, self._steps)
        self._start, self._steps, self._landings, self._waited = now, 0, 0, 0.0
        if (
            self.said
            or late.wall_s <= 0
            or late.waited_s < self.floor_s
            or late.waited_s <= self.share * late.wall_s
        ):
            return None
        self.said = True
        return late
