"""overlap.comm.seconds: the public API's timeouts, checked in one place."""

from __future__ import annotations

import datetime
import math

import numpy as np
import pytest

from overlap.comm.seconds import positive_seconds, wait_seconds


def test_a_wait_polls_at_zero_and_waits_for_ever_at_none_or_inf() -> None:
    assert wait_seconds(None) is None and wait_seconds(math.inf) is None
    assert wait_seconds(0) == 0.0 and wait_seconds(np.float32(0.5)) == 0.5
    assert wait_seconds(datetime.timedelta(seconds=2)) == 2.0
    for bad in (-0.1, float("nan"), -math.inf):
        with pytest.raises(ValueError, match="0 or more seconds"):
            wait_seconds(bad)
    for bad in ("1", True, [1]):
        with pytest.raises(TypeError, match="takes seconds"):
            wait_seconds(bad)


def test_a_job_timeout_is_positive_and_finite() -> None:
    assert positive_seconds(3) == 3.0 and positive_seconds(np.int64(3)) == 3.0
    assert positive_seconds(datetime.timedelta(minutes=1)) == 60.0
    for bad in (0, -1, math.inf, float("nan"), datetime.timedelta(0)):
        with pytest.raises(ValueError, match="positive, finite seconds"):
            positive_seconds(bad)
    with pytest.raises(TypeError, match="takes seconds"):
        positive_seconds("30")
