"""The clean-up guardian (overlap.bench.guard) with folders only, so no root is needed: a
process killed by SIGKILL, its whole process group with it, still has what it told its
guardian removed; a process that releases its guardian has nothing removed. (Namespaces:
tests/hosts/test_multi_host.py, as root.)"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from overlap.bench import guard as guard_module
from overlap.runtime import pid_alive
from tests.polling import until

GUARD = guard_module.__file__

# The child loads guard.py by path, as the guardian itself runs: no torch import
CHILD = """
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("guard", sys.argv[1])
guard = importlib.util.module_from_spec(spec); spec.loader.exec_module(guard)
g = guard.Guardian()
os.makedirs(sys.argv[2])
g.folder(sys.argv[2])
print(g.pid, flush=True)
if sys.argv[3] == "release":
    g.release()
    print("released", flush=True)
else:
    time.sleep(60)
"""


def _child(folder: Path, mode: str) -> tuple[subprocess.Popen[str], int]:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, GUARD, str(folder), mode],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, to be killed whole below
    )
    assert child.stdout is not None
    line = child.stdout.readline().strip()
    assert line.isdigit(), line
    return child, int(line)


def _gone(pid: int, within: float = 15.0) -> bool:
    return until(lambda: not pid_alive(pid), within)


def _ignoring(pid: int, *signals: int, within: float = 15.0) -> None:
    """Wait until process ``pid`` ignores ``signals`` (its SigIgn mask in /proc)."""
    want = sum(1 << (s - 1) for s in signals)

    def mask() -> int:
        status = Path(f"/proc/{pid}/status").read_text()
        return int(next(x for x in status.splitlines() if x.startswith("SigIgn:")).split()[1], 16)

    assert until(lambda: mask() & want == want, within, every=0.02), (
        f"pid {pid} does not ignore {signals}: {mask():x}"
    )


@contextlib.contextmanager
def _sleeping_child(folder: Path) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """A child that made ``folder``, told its guardian, and sleeps; (it, the guardian's
    pid). On the way out: the folder is gone once the child is, and nothing is left."""
    child, guardian = _child(folder, "sleep")
    try:
        assert folder.is_dir() and pid_alive(guardian)
        yield child, guardian
        child.wait(timeout=30)
        assert _gone(guardian), "the guardian did not finish within 15 s"
        assert not folder.exists()
    finally:
        if child.poll() is None:
            child.kill()
        if pid_alive(guardian):
            os.kill(guardian, signal.SIGKILL)


def test_a_process_killed_with_its_group_has_its_folder_removed(tmp_path: Path) -> None:
    with _sleeping_child(tmp_path / "made") as (child, _):
        os.killpg(child.pid, signal.SIGKILL)  # a CI runner's hard timeout: the whole group


def test_a_released_guardian_exits_and_removes_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "kept"
    child, guardian = _child(folder, "release")
    out, _ = child.communicate(timeout=30)
    assert child.returncode == 0 and "released" in out
    assert _gone(guardian, within=5.0)
    assert folder.is_dir()  # the caller's own clean-up is the caller's


def test_the_guardian_ignores_the_signals_of_a_terminal(tmp_path: Path) -> None:
    """Ctrl-C or a SIGTERM reaching the guardian must not stop it before its work: it
    removes the folder only once its process is gone."""
    folder = tmp_path / "made"
    with _sleeping_child(folder) as (child, guardian):
        _ignoring(guardian, signal.SIGINT, signal.SIGTERM)  # its handlers are set
        os.kill(guardian, signal.SIGINT)
        os.kill(guardian, signal.SIGTERM)
        time.sleep(0.3)
        assert pid_alive(guardian) and folder.is_dir()
        child.kill()


def test_without_a_guardian_the_calls_do_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """No process could be started: a warning, and the caller's own clean-up as before."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError("no processes left")

    monkeypatch.setattr(guard_module.subprocess, "Popen", refuse)
    g = guard_module.Guardian()
    assert g.pid == 0
    g.namespace("ovh1-0")
    g.folder("/nonexistent")
    g.release()


# The owner starts a sleeper that ends with it: through with_parent's wrapper ("exec"), or
# by calling exit_with_parent itself ("watch"); it prints the sleeper's pid and waits.
OWNER = """
import importlib.util, subprocess, sys, time
spec = importlib.util.spec_from_file_location("guard", sys.argv[1])
guard = importlib.util.module_from_spec(spec); spec.loader.exec_module(guard)
if sys.argv[2] == "exec":
    cmd = guard.with_parent([sys.executable, "-c", "import time; time.sleep(60)"])
else:
    cmd = [sys.executable, "-c", (
        "import importlib.util, sys, time\\n"
        "spec = importlib.util.spec_from_file_location('guard', sys.argv[1])\\n"
        "guard = importlib.util.module_from_spec(spec); spec.loader.exec_module(guard)\\n"
        "guard.exit_with_parent(0.05)\\n"
        "print('watching', flush=True)\\n"
        "time.sleep(60)\\n"), sys.argv[1]]
child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
if sys.argv[2] == "watch":
    child.stdout.readline()
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux")
@pytest.mark.parametrize("how", ["exec", "watch"])
def test_a_command_ends_with_the_process_that_started_it(how: str) -> None:
    """``kill -9`` of a benchmark's launcher: what it started ends within seconds (before,
    ``python -m overlap.bench.train`` and its ranks, or the demo's ranks, ran on)."""
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, GUARD, how], stdout=subprocess.PIPE, text=True
    )
    assert owner.stdout is not None
    line = owner.stdout.readline().strip()
    assert line.isdigit(), line
    sleeper = int(line)
    try:
        time.sleep(0.3)  # the wrapper has exec'd into the sleeper
        assert pid_alive(sleeper)
        owner.kill()
        owner.wait(timeout=30)
        assert _gone(sleeper), "the command outlived the process that started it"
    finally:
        for pid in (owner.pid, sleeper):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def test_with_parent_runs_the_command_as_it_is() -> None:
    cmd = guard_module.with_parent([sys.executable, "-c", "import sys; print(sys.argv[1:])", "a b"])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "['a b']", done
