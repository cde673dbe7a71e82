"""Environment knobs: a bad value is refused with the variable's name and the fix."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from overlap.comm.knobs import number, switch


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


@pytest.mark.parametrize(
    "raw,value",
    [
        ("1", True),
        ("true", True),
        ("Yes", True),
        (" ON ", True),
        ("0", False),
        ("False", False),
        ("no", False),
        ("off", False),
        ("", None),
    ],
)
def test_a_switch_reads_the_usual_words(
    monkeypatch: pytest.MonkeyPatch, raw: str, value: bool | None
) -> None:
    monkeypatch.setenv("OVERLAP_TEST_SWITCH", raw)
    for default in (False, True):
        assert switch("OVERLAP_TEST_SWITCH", default) is (default if value is None else value)


SWITCHES = {
    # name: code that reads it (at import, or at init_distributed) and prints what it decided
    "OVERLAP_DEBUG": "import overlap.comm.debug as d; print(d.env_enabled())",
    "OVERLAP_NUMBA": "import overlap.compression.codec_numba as c; print(c._NUMBA_ON)",
    "OVERLAP_MPI_CUDA_AWARE": "import overlap; overlap.init_distributed('mpi'); "
    "from overlap.comm import state; print(state.active().cuda_aware)",
}


@pytest.mark.parametrize("name", list(SWITCHES))
def test_each_switch_takes_true_and_refuses_what_it_cannot_read(name: str) -> None:
    """OVERLAP_MPI_CUDA_AWARE=true was read as off and OVERLAP_DEBUG=no as on, silently
    (forty-eighth session): every switch reads the same words now, and refuses others."""
    if name == "OVERLAP_MPI_CUDA_AWARE":
        pytest.importorskip("mpi4py")
    for raw, want in (("true", "True"), ("maybe", f"environment variable {name}='maybe'")):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        proc = subprocess.run(
            [sys.executable, "-c", SWITCHES[name]],
            env={**env, name: raw},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert want in (proc.stdout if raw == "true" else proc.stderr), (
            proc.stdout + proc.stderr[-2000:]
        )
