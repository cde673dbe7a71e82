"""Clean-up that outlives its process: a guardian removes the network namespaces (with
what runs in them and their /etc/netns files) and the folders a process made, when that
process dies, SIGKILL included.

Why: :func:`~overlap.bench.hosts.namespace_hosts` and
:func:`~overlap.bench.link.shaped_link` remove what they made on the way out, also on an
exception or SIGTERM; but SIGKILL (a CI runner's hard timeout, the OOM killer, ``kill -9``)
runs no code in the process. Measured before this module (fifty-sixth session): an
``overlap demo`` killed by SIGKILL left its link namespace and its /etc/netns files for
good, a killed cluster's namespaces stayed until the next ``namespace_hosts`` swept them,
and a cluster's temporary folder was never removed (twenty had piled up in /tmp over one
day of test runs, one from each run of the test that kills a cluster's process).

How: before it makes anything, the process starts a guardian, a small Python process in
a session of its own (a kill of the process group, Ctrl-C in the terminal or a closed
terminal do not reach it), and tells it, on a pipe, each thing just before making it.
When the process has removed everything itself it says so (``done``) and the guardian
exits, removing nothing. When the pipe ends without that, the process died (the kernel
closes its end of the pipe, whatever killed it), and the guardian removes everything it
was told of. Removing is idempotent, so a death in the middle of the process's own
clean-up is covered too. A guardian killed along with its process (``kill -9`` of both)
leaves the rest to :func:`~overlap.bench.hosts.sweep_stale`, which the next run calls.

This file imports only the standard library and runs as a script (``python -I -S
guard.py``): a guardian starts in tens of milliseconds, without importing torch. How the
processes stop on Ctrl-C or SIGTERM, where code does run, is :mod:`overlap.bench.stopping`'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import IO, NoReturn

__all__ = [
    "Guardian",
    "exit_with_parent",
    "remove_namespace",
    "with_parent",
]

log = logging.getLogger("overlap.bench.guard")

# ``ip netns exec NAME`` bind-mounts the files of /etc/netns/NAME over their namesakes in /etc
NETNS_ETC = "/etc/netns"
_DONE = "done"


def _this_script() -> list[str]:
    """The command that runs this file as a script: isolated and without site, so that it
    starts in tens of milliseconds (stdlib only, no torch) as the guardian or as
    :func:`with_parent`'s wrapper."""
    return [sys.executable, "-I", "-S", os.path.abspath(__file__)]


def remove_namespace(name: str) -> None:
    """Kill what still runs inside namespace ``name``, then delete it and its /etc files
    (and /etc/netns itself once empty). Nothing happens for a namespace that is not there."""
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
    for pid in pids.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
            os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    shutil.rmtree(os.path.join(NETNS_ETC, name), ignore_errors=True)
    with contextlib.suppress(OSError):  # made by link._hosts_file; kept while anyone uses it
        os.rmdir(NETNS_ETC)


class Guardian:
    """The guardian of what one ``with`` block makes: tell it each namespace
    (:meth:`namespace`) and folder (:meth:`folder`) before making it, and :meth:`release`
    it once they are all removed. If the guardian cannot be started (no ``sys.executable``,
    no process left to start), a warning says so and the clean-up is the caller's own
    ``finally`` alone, as before."""

    def __init__(self) -> None:
        self.pid = 0
        self._proc: subprocess.Popen[str] | None = None
        try:
            self._proc = subprocess.Popen(
                _this_script(),
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                text=True,
                start_new_session=True,  # no signal meant for this process group reaches it
            )
            self.pid = self._proc.pid
        except OSError as exc:
            log.warning(
                "could not start the guardian that removes namespaces after a SIGKILL (%s); "
                "a killed run's namespaces are removed by the next run instead",
                exc,
            )

    def _say(self, line: str) -> None:
        proc = self._proc
        if proc is None or proc.stdin is None:
            return
        try:
            proc.stdin.write(line + "\n")
            proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            # the guardian is gone (killed by hand): the next run's sweep is the fallback
            log.warning("the clean-up guardian (pid %d) has gone away", self.pid)
            self._proc = None

    def namespace(self, name: str) -> None:
        """Remove network namespace ``name`` if this process dies (say it before making it)."""
        self._say(f"ns {name}")

    def folder(self, path: str) -> None:
        """Remove folder ``path`` if this process dies."""
        self._say(f"dir {path}")

    def release(self) -> None:
        """Everything told has been removed: the guardian exits, removing nothing."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            assert proc.stdin is not None
            proc.stdin.write(_DONE + "\n")
            proc.stdin.close()
        except (BrokenPipeError, OSError, ValueError):
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# A process's exit code when it ends because its parent is gone (no one reads it)
PARENT_GONE = 75
_PR_SET_PDEATHSIG = 1  # prctl(2)


def with_parent(cmd: list[str]) -> list[str]:
    """``cmd`` as a command that gets SIGTERM when this process dies, SIGKILL included.

    Why: a benchmark the CLI runs as a subprocess (``python -m overlap.bench.train``,
    torchrun, mpiexec) ran on after ``kill -9`` of ``overlap bench``, with its ranks, to
    the end of its run. Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``) is set by
    a small wrapper that then ``exec``s ``cmd`` (the setting survives the exec), rather
    than in a ``preexec_fn`` (unsafe with threads). It fires when the thread that started
    the command ends, so start it from a thread that lives as long as the command: the
    main thread. Elsewhere than Linux, ``cmd`` unchanged."""
    if not sys.platform.startswith("linux"):
        return list(cmd)
    return [*_this_script(), "--exec", str(os.getpid()), *cmd]


def _exec_with_parent(parent: int, cmd: list[str]) -> NoReturn:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        sys.stderr.write(f"overlap: prctl failed (errno {ctypes.get_errno()}); running on\n")
    if os.getppid() != parent:  # it died before the signal was set
        os._exit(PARENT_GONE)
    os.execvp(cmd[0], cmd)


def exit_with_parent(poll_s: float = 0.5) -> None:
    """End this process (exit code :data:`PARENT_GONE`) soon after its parent is gone: a
    daemon thread notices the reparenting (``os.getppid()`` changes). For worker processes
    whose parent is a launcher running in Python (the demo's ranks under torch's elastic
    launcher, which is the ``overlap demo`` process itself): killed by SIGKILL, it left
    them training on to the end of their run."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(PARENT_GONE)

    threading.Thread(target=watch, name="overlap-parent-watch", daemon=True).start()


def _serve(lines: IO[str]) -> None:
    """The guardian's side: read what the process makes until the pipe ends; remove it all
    unless the process said ``done`` first. The namespaces go first, last made first (what
    runs inside them is killed, so nothing writes into the folders any more), then the
    folders; a namespace that cannot be removed (``ip`` gone) does not keep the folders."""
    names: list[str] = []
    folders: list[str] = []
    for line in lines:
        kind, _, what = line.rstrip("\n").partition(" ")
        if kind == _DONE:
            return
        if kind == "ns" and what:
            names.append(what)
        elif kind == "dir" and what:
            folders.append(what)
    for name in reversed(names):
        with contextlib.suppress(OSError):
            remove_namespace(name)
    for path in folders:
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "--exec":  # with_parent's wrapper
        _exec_with_parent(int(sys.argv[2]), sys.argv[3:])
    # Ctrl-C or a SIGTERM aimed at this session must not stop the clean-up half way
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _serve(sys.stdin)
