"""on_nonfinite, the policy every stateful compressor shares: checked where it is given."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from overlap.compression import FP8, Auto, Compressor, Int8, NoCompression, OneBit, PowerSGD


@pytest.mark.parametrize("make", [OneBit, PowerSGD, Int8, FP8, Auto])
def test_every_stateful_compressor_takes_raise_or_skip_and_nothing_else(
    make: Callable[..., Compressor],
) -> None:
    skipper = make(on_nonfinite="skip")
    assert not skipper.step_skipped()
    with pytest.raises(ValueError, match=r"^on_nonfinite must be 'raise' or 'skip', got 'nan'$"):
        make(on_nonfinite="nan")
    if make is not Auto:
        assert "on_nonfinite='skip'" in repr(skipper)
        assert skipper.on_nonfinite == "skip" and make().on_nonfinite == "raise"  # type: ignore[attr-defined]


def test_auto_gives_the_mode_to_its_default_candidates_only() -> None:
    auto = Auto(on_nonfinite="skip")
    modes = {c.name: getattr(c, "on_nonfinite", None) for c in auto.candidates}
    assert modes == {"none": None, "fp16": None, "onebit": "skip", "powersgd": "skip"}
    assert {getattr(c, "on_nonfinite", None) for c in Auto().candidates} == {None, "raise"}
    # with candidates of your own the mode is theirs: a second one would be ignored
    with pytest.raises(ValueError, match="build each with its on_nonfinite"):
        Auto([NoCompression(), OneBit()], on_nonfinite="skip")


def test_a_skip_flag_lasts_until_the_next_step_begins() -> None:
    c = PowerSGD(on_nonfinite="skip")
    c.last_skipped = True  # as a skipped bucket leaves it
    assert c.step_skipped()
    c.begin_step()
    assert not c.step_skipped() and not NoCompression().step_skipped()
