"""overlap.optim.late: windows of landings, late when their waits pass a share of them and
a floor."""

from __future__ import annotations

from overlap.optim.late import Late, LateLandings


def test_a_window_is_one_landing_per_fragment_and_late_past_the_share() -> None:
    late = LateLandings(per_window=2, share=0.1)
    late.step(0.0)
    late.step(1.0)
    assert late.landed(0.05, 1.5) is None  # one landing of two: no window yet
    late.step(2.0)
    # the window: 3 steps from t = 0 to 4.0, waited 0.05 + 0.2 = 0.25 s (6%): not late
    assert late.landed(0.2, 4.0) is None and not late.said
    late.step(4.0)
    assert late.landed(0.3, 5.0) is None
    late.step(5.0)
    # the next window starts at the last one's end: 2 steps, 4.0 to 6.0, waited 0.5 s (25%)
    got = late.landed(0.2, 6.0)
    assert got == Late(waited_s=0.5, wall_s=2.0, steps=2) and late.said


def test_it_is_said_once() -> None:
    late = LateLandings(per_window=1, share=0.1)
    late.step(0.0)
    assert late.landed(0.5, 1.0) is not None
    late.step(1.0)
    assert late.landed(0.9, 2.0) is None  # as late again: said already


def test_landings_before_any_step_and_exactly_at_the_share_are_not_late() -> None:
    late = LateLandings(per_window=1, share=0.1)
    assert late.landed(1.0, 1.0) is None  # no step counted yet: nothing to weigh it by
    late.step(0.0)
    assert late.landed(0.1, 1.0) is None  # 10% of 1 s: at the share, not past it


def test_a_short_wait_is_not_late_however_large_its_share() -> None:
    """A tiny model's 2 ms steps wait half their time for 1 ms reductions: not a schedule
    that H or delay would fix, and nothing a run notices (examples/diloco.py said it)."""
    late = LateLandings(per_window=1, share=0.1, floor_s=0.1)
    late.step(0.0)
    assert late.landed(0.009, 0.017) is None
    late.step(0.017)
    assert late.landed(0.1, 0.2) is not None  # a tenth of a second, 55% of the window
