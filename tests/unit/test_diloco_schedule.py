"""DiLoCo's schedule and fragment split, and the quantizers' codes, in one process."""

from __future__ import annotations

import pytest
import torch

from overlap import FP8, Int8
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


@pytest.mark.parametrize("cls", [Int8, FP8])
def test_codes_round_trip_within_the_resolution(cls: type[Int8]) -> None:
    q = cls(block=16)
    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    x[16:32] = 0.0  # an all-zero block: scale 0, codes 0
    codes, scales = q._quantize(x)
    assert codes.dtype == torch.uint8 and codes.numel() == 64 and scales.numel() == 4
    back = q._dequantize(codes, scales)
    assert torch.equal(back[16:32], torch.zeros(16))
    rel = 0.5 / 127 if cls is Int8 else 1 / 16  # half a step; e4m3 has 3 mantissa bits
    for b in range(4):
        blk = slice(16 * b, 16 * (b + 1))
        assert (back[blk] - x[blk]).abs().max() <= rel * x[blk].abs().max() + 1e-7


def test_quantizer_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="block must be a positive int"):
        Int8(block=0)
    st = Int8(block=8).state_dict()
    with pytest.raises(ValueError, match="block=8"):
        Int8(block=16).load_state_dict(st)
