"""DiLoCo's schedule and fragment split, in one process."""

from __future__ import annotations

import pytest

from overlap.optim.diloco import offsets, schedule, split


def test_one_fragment_no_delay_is_diloco() -> None:
    assert schedule(8, 1, 0, 17) == [
        (8, "issue", 0),
        (8, "land", 0),
        (16, "issue", 0),
        (16, "land", 0),
    ]


def test_streaming_fragments_sync_in_turn_and_land_after_the_delay() -> None:
    assert offsets(8, 2) == [4, 0] and offsets(8, 4) == [2, 4, 6, 0]
    assert schedule(8, 2, 2, 18) == [
        (4, "issue", 0),
        (6, "land", 0),
        (8, "issue", 1),
        (10, "land", 1),
        (12, "issue", 0),
        (14, "land", 0),
        (16, "issue", 1),
        (18, "land", 1),
    ]
    # a landing and an issue in one step: the landing first
    ev = schedule(4, 2, 2, 8)
    assert ev[ev.index((4, "land", 0)) + 1] == (4, "issue", 1)


def test_split_is_contiguous_balanced_and_never_empty() -> None:
    assert split([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert split([10, 10, 10, 10, 100], 3) == [[0, 1, 2], [3], [4]]
    assert split([1, 1, 1], 3) == [[0], [1], [2]]
    assert split([100, 1, 1, 1], 2) == [[0], [1, 2, 3]]


@pytest.mark.parametrize(
    ("args", "msg"),
    [
        ((0, 1, 0), "sync_every must be an int >= 1"),
        ((4, 0, 0), "fragments must be an int >= 1"),
        ((4, 1, -1), "delay must be an int >= 0"),
        ((4, 1, 4), "must be less than sync_every"),
    ],
)
def test_bad_schedules_are_refused(args: tuple[int, int, int], msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        schedule(*args, 10)


@pytest.mark.parametrize(
    ("cores", "ranks", "threads", "spare"),
    [(2, 2, 1, False), (2, 1, 1, True), (16, 2, 1, True), (16, 4, 3, True), (16, 4, 4, False),
     (3, 2, 1, False), (16, 0, 1, True)],
)  # fmt: skip
def test_a_pass_thread_is_the_default_only_with_a_core_to_spare(
    cores: int, ranks: int, threads: int, spare: bool
) -> None:
    from overlap.optim.diloco import spare_core

    assert spare_core(cores, ranks, threads) is spare


@pytest.mark.parametrize(("h", "f"), [(32, 8), (32, 4), (32, 2), (32, 1), (16, 8), (8, 4), (8, 2)])
def test_the_bench_lands_streaming_fragments_between_issues(h: int, f: int) -> None:
    """``overlap bench train``'s streaming delay is about H / 2, and no landing shares its
    step with an issue (H // 2 did when H / F is even: that step carried both)."""
    from overlap.bench.train import streaming_delay

    d = streaming_delay(h, f)
    assert 1 <= d < h and abs(d - h // 2) <= h // f // 2, d
    events = schedule(h, f, d, 4 * h)
    issues = {t for t, kind, _ in events if kind == "issue"}
    lands = {t for t, kind, _ in events if kind == "land"}
    assert lands and not issues & lands, (d, sorted(issues & lands))


def test_the_bench_delay_keeps_h_over_2_where_every_step_issues() -> None:
    from overlap.bench.train import streaming_delay

    assert streaming_delay(8, 8) == 4 and streaming_delay(2, 2) == 1 and streaming_delay(1, 1) == 0
