"""overlap.bench.stopping: children stopped at once when they got no signal, and a module
run quiet on Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from overlap.bench import stopping


def test_children_that_got_no_signal_are_stopped_at_once() -> None:
    """After a SIGTERM to the CLI alone (``kill``), or an error of its own, its children
    got nothing: they are sent SIGTERM at once, not given the 20 s a Ctrl-C's children get
    to end on their own (``kill`` of ``overlap bench train --link 1gbit`` took 21 s)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], text=True)
    t0 = time.monotonic()
    stopping.stop_children([child], SystemExit(143))
    assert time.monotonic() - t0 < 5.0
    assert child.returncode == -signal.SIGTERM


def test_python_module_runs_a_module_as_dash_m_and_is_quiet_on_ctrl_c(tmp_path: Path) -> None:
    """``python_module``: the module runs as ``__main__`` with ``-m``'s ``sys.argv``; an
    error raised by a Ctrl-C (a KeyboardInterrupt, or one raised while handling it, as
    numpy's interrupted import does) prints nothing; any other error prints as usual."""
    (tmp_path / "showargs.py").write_text("import sys\nprint(__name__, sys.argv[1:])\n")
    (tmp_path / "stopped.py").write_text(
        "try:\n    raise KeyboardInterrupt\nexcept KeyboardInterrupt:\n"
        "    raise ImportError('cannot load module more than once per process')\n"
    )
    (tmp_path / "broken.py").write_text("raise ValueError('a bug')\n")

    def run(module: str, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = stopping.python_module(module, *args)
        return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=60)

    shown = run("showargs", "a", "b")
    assert shown.returncode == 0 and shown.stdout == "__main__ ['a', 'b']\n", shown
    stopped = run("stopped")
    assert stopped.returncode == 1 and stopped.stderr == "", stopped
    broken = run("broken")
    assert broken.returncode == 1 and "ValueError: a bug" in broken.stderr, broken


def test_imports_held_takes_a_ctrl_c_after_the_imports(tmp_path: Path) -> None:
    """A Ctrl-C that comes while ``imports_held`` imports is raised once the imports are
    done, not inside them (an interrupted import of torch or numpy broke it)."""
    (tmp_path / "slow.py").write_text(
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(0.2)\nDONE = 1\n"
    )
    code = (
        "import sys\n"
        "from overlap.bench.stopping import imports_held\n"
        "try:\n"
        "    imports_held('slow')\n"
        "except KeyboardInterrupt:\n"
        "    print('after', getattr(sys.modules.get('slow'), 'DONE', None))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert out.stdout.strip() == "after 1", out.stdout + out.stderr
