"""Environment knobs: a bad value is refused with the variable's name and the fix."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from overlap.comm.knobs import number


def test_unset_or_empty_gives_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OVERLAP_TEST_KNOB", raising=False)
    assert number("OVERLAP_TEST_KNOB", 7, low=0, high=10, unit="things") == 7
    monkeypatch.setenv("OVERLAP_TEST_KNOB", "  ")
    assert number("OVERLAP_TEST_KNOB", 7, low=0, high=10, unit="things") == 7


@pytest.mark.parametrize("raw,value", [("0", 0.0), ("2.5", 2.5), (" 10 ", 10.0)])
def test_a_number_in_range_is_read(monkeypatch: pytest.MonkeyPatch, raw: str, value: float) -> None:
    monkeypatch.setenv("OVERLAP_TEST_KNOB", raw)
    assert number("OVERLAP_TEST_KNOB", 7, low=0, high=10, unit="things") == value


@pytest.mark.parametrize("raw", ["abc", "inf", "nan", "-1", "10.5", "1e9"])
def test_anything_else_names_the_variable_and_the_fix(
    monkeypatch: pytest.MonkeyPatch, raw: str
) -> None:
    monkeypatch.setenv("OVERLAP_TEST_KNOB", raw)
    with pytest.raises(ValueError) as e:
        number("OVERLAP_TEST_KNOB", 7, low=0, high=10, unit="things")
    msg = str(e.value)
    assert f"OVERLAP_TEST_KNOB={raw!r}" in msg and "from 0 to 10" in msg and "unset it" in msg


KNOBS = ["OVERLAP_GLOO_SPIN_US", "OVERLAP_MPI_SPIN_US", "DEEPSPEED_TIMEOUT"]


@pytest.mark.parametrize("name", KNOBS)
def test_importing_overlap_with_a_bad_knob_says_which(name: str) -> None:
    env = {**os.environ, name: "abc"}
    code = "import overlap.comm.progress"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0
    assert f"environment variable {name}='abc'" in proc.stderr, proc.stderr[-2000:]
