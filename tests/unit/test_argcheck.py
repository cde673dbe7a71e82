"""overlap.argcheck and the constructors that use it: a bad number fails where it is given."""

from __future__ import annotations

import math

import numpy as np
import pytest

from overlap.argcheck import count, positive_real
from overlap.compression import Auto, OneBit, PowerSGD


def test_count_takes_ints_only() -> None:
    assert count("n", 3, 1) == 3 and count("n", np.int64(0), 0) == 0
    for bad in (1.5, "2", True, None):
        with pytest.raises(TypeError, match=r"^n must be an int >= 1, got "):
            count("n", bad, 1)
    with pytest.raises(ValueError, match=r"^n must be an int >= 1, got 0$"):
        count("n", 0, 1)


def test_positive_real_refuses_nan_inf_and_non_numbers() -> None:
    assert positive_real("x", 2) == 2.0 and positive_real("x", 0, zero=True) == 0.0
    for bad in (0, -1, math.nan, math.inf):
        with pytest.raises(ValueError, match=r"^x must be a finite number > 0, got "):
            positive_real("x", bad)
    with pytest.raises(TypeError, match=r"^x must be a number, got '1'$"):
        positive_real("x", "1")


@pytest.mark.parametrize(
    ("make", "kind", "says"),
    [
        # before: taken, then a TypeError inside the first compressed step, on the worker
        (lambda: PowerSGD(rank=1.5), TypeError, "rank must be an int >= 1, got 1.5"),
        (lambda: PowerSGD(start_iter=2.5), TypeError, "start_iter must be an int >= 0"),
        # before: taken, and no tensor was ever compressed (every comparison with NaN fails)
        (
            lambda: PowerSGD(min_compression_rate=math.nan),
            ValueError,
            "min_compression_rate must be a finite number >= 0, got nan",
        ),
        # before: OneBit(warmup_steps=1.5) taken; "2": a comparison's TypeError
        (lambda: OneBit(warmup_steps=1.5), TypeError, "warmup_steps must be an int >= 0"),
        (lambda: OneBit(warmup_steps="2"), TypeError, "warmup_steps must be an int >= 0"),
        (lambda: Auto(trial_steps=0), ValueError, "trial_steps must be an int >= 1, got 0"),
        (lambda: Auto(remeasure_every=2.5), TypeError, "remeasure_every must be an int >= 1"),
    ],
)
def test_constructors_refuse_bad_numbers_where_they_are_given(
    make: object, kind: type[Exception], says: str
) -> None:
    with pytest.raises(kind, match=f"^{says}"):
        make()  # type: ignore[operator]
