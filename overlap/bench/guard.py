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
guard.py``): a guardian starts in tens of milliseconds, without importing torch.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO, Any, NoReturn, TypeVar, cast

__all__ = [
    "Guardian",
    "exit_with_parent",
    "interrupt_once",
    "mpiexec_leftovers_removed",
    "python_module",
    "remove_namespace",
    "run_child",
    "stop_children",
    "terminate_as_exit",
    "with_parent",
]

log = logging.getLogger("overlap.bench.guard")
F = TypeVar("F", bound=Callable[..., Any])

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


# How long a child that got the same Ctrl-C may take to end on its own (run_child)
CHILD_GRACE_S = 20.0


def run_child(
    cmd: list[str], env: dict[str, str] | None = None, capture: bool = False
) -> tuple[str | None, int]:
    """``subprocess.run(cmd)``: (its stdout if ``capture``, its exit code). On an interrupt
    of this process (Ctrl-C, which reaches the child too: one process group) the child is
    given :data:`CHILD_GRACE_S` to end on its own, then SIGTERM, then SIGKILL (at once on a
    second Ctrl-C), and the interrupt goes on.

    Why: ``subprocess.run`` kills its child 0.25 s after a KeyboardInterrupt, and the child
    of ``overlap bench train``, killed in the middle of its own clean-up (its ranks, its
    temporary files), left its multiprocessing folder in /tmp: one per Ctrl-C (measured,
    fifty-sixth session)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE if capture else None, text=True, env=env)
    try:
        out, _ = proc.communicate()
    except BaseException as exc:
        stop_children([proc], ctrl_c=isinstance(exc, KeyboardInterrupt))
        raise
    return out, proc.returncode


def _interrupted(signum: int, frame: object) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.getLogger("overlap").setLevel(logging.ERROR)
    raise KeyboardInterrupt


def interrupt_once(fn: F) -> F:
    """Decorate a rank's function (run on its main thread): while it runs, the process's
    first SIGINT raises KeyboardInterrupt and the rest are ignored, with overlap's
    warnings left out from then on. It returns with the previous handler back; raising,
    it leaves this one (the process is on its way out: see below).

    Why: a demo rank shares the terminal's process group with torch's launcher, so a
    Ctrl-C reached it twice: from the terminal, and again from the launcher, which passes
    the signal on to its workers. The second landed in the rank's exit, where overlap
    waits for its ops still in flight (overlap.comm.quiesce), and stopped that wait; the op
    then failed during interpreter shutdown and the rank died with "terminate called
    without an active exception" and "Fatal Python error: Aborted" (fifty-seventh session,
    a Ctrl-C 15 s into ``overlap demo``), or the KeyboardInterrupt surfaced as an
    "Exception ignored in atexit callback" traceback. And each rank's scheduler warned
    that its step was interrupted, under the CLI's ``overlap: interrupted``: a rank the
    user stopped is on its way out, and says nothing more of it."""

    @functools.wraps(fn)
    def once(*args: Any, **kwargs: Any) -> Any:
        previous = signal.signal(signal.SIGINT, _interrupted)
        out = fn(*args, **kwargs)
        signal.signal(signal.SIGINT, previous)
        return out

    return cast(F, once)


# ``python -m MODULE ARGS`` (run by :func:`python_module`), quiet on Ctrl-C. While it imports
# MODULE's package (torch with it), SIGINT waits (blocked): a KeyboardInterrupt raised inside
# an import broke it (numpy's, interrupted, failed again with "cannot load module more than
# once per process"; torch's ended the process with "terminate called after throwing an
# instance of 'pybind11::error_already_set'"). Then an error raised by a Ctrl-C (a
# KeyboardInterrupt, or one raised while handling it) prints no traceback; it stays uncaught,
# so atexit hooks see it (an MPI rank aborts its job, overlap.comm.init).
_QUIET_SOURCE = """\
import signal, sys
mask = getattr(signal, "pthread_sigmask", lambda how, sigs: None)
mask(signal.SIG_BLOCK, {signal.SIGINT})
def quiet(t, v, tb, default=sys.excepthook):
    e = v
    for _ in range(64):
        if e is None:
            break
        if isinstance(e, KeyboardInterrupt):
            return
        e = e.__context__
    default(t, v, tb)
sys.excepthook = quiet
import importlib, runpy
m = sys.argv.pop(1)
try:
    if "." in m:  # its package only: the module itself runs once, as __main__
        importlib.import_module(m.rpartition(".")[0])
finally:
    mask(signal.SIG_UNBLOCK, {signal.SIGINT})
runpy.run_module(m, run_name="__main__", alter_sys=True)
"""
# one line: launchers pass it on as an argument
_QUIET_MAIN = f"exec({_QUIET_SOURCE!r})"


def python_module(module: str, *args: str, python: str = sys.executable) -> list[str]:
    """The command that runs ``python -m module args`` and ends on Ctrl-C with no
    traceback, whenever the Ctrl-C comes: while it imports torch (the first seconds) too.
    Ctrl-C waits while it imports the module's package (torch with it), where an interrupt
    broke imports; then the KeyboardInterrupt stays uncaught (Python's exit by SIGINT;
    atexit hooks see it, so an MPI rank aborts its job, overlap.comm.init), only its
    printing left out (see ``_QUIET_SOURCE``).

    Why: Ctrl-C reaches a benchmark's children as it reaches the CLI, which says
    ``overlap: interrupted`` once; each child printed its KeyboardInterrupt's traceback
    above it, and a child that was still importing torch (a Ctrl-C in the first 1-3 s of
    ``overlap bench train``) did so whatever its own ``main`` caught (fifty-seventh
    session). The quiet hook must be in place before the imports, so it is the command
    itself: a ``-c`` line that sets ``sys.excepthook`` and runs the module as ``-m`` would
    (``runpy``, ``sys.argv`` as ``-m`` makes it)."""
    return [python, "-c", _QUIET_MAIN, module, *args]


_HYDRA_TOPOLOGY = "hydra_hwloc_xmlfile_"


def _hydra_files() -> set[str]:
    """The topology files MPICH's mpiexec (hydra) writes: always in /tmp (its path is
    compiled in), whatever TMPDIR says."""
    out: set[str] = set()
    with contextlib.suppress(OSError):
        out.update(
            os.path.join("/tmp", f) for f in os.listdir("/tmp") if f.startswith(_HYDRA_TOPOLOGY)
        )
    return out


_SHM, _MPICH_SEGMENT = "/dev/shm", "mpich_shm_"
LEFTOVER_WAIT_S = 5.0  # how long an aborted job's leftovers may stay held by exiting ranks


def _mpich_segments() -> set[str]:
    """MPICH's shared-memory segments (its ranks' on-host channel), as paths."""
    with contextlib.suppress(OSError):
        return {os.path.join(_SHM, f) for f in os.listdir(_SHM) if f.startswith(_MPICH_SEGMENT)}
    return set()


def _in_use(paths: set[str]) -> set[str]:
    """Those of ``paths`` that some living process holds open or maps."""
    held: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target in paths:
                        held.add(target)
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
            text = maps.read()
            held.update(p for p in paths if p in text)
    return held


@contextlib.contextmanager
def mpiexec_leftovers_removed() -> Iterator[None]:
    """Around runs of MPICH's mpiexec: on the way out, remove what an aborted job leaves,
    the ``/tmp/hydra_hwloc_xmlfile_*`` topology files and ``/dev/shm/mpich_shm_*``
    segments (2 MiB each) that appeared meanwhile and that no living process holds open or
    maps (another job's, running, is left alone).

    Why: MPICH 5.0.2 removes both when a job ends, but not when a rank calls ``MPI_Abort``
    (measured: one of each per abort, with plain mpi4py too), and an MPI rank aborts its
    job on Ctrl-C (overlap.comm.init; the MPI benchmark's ranks, overlap.bench.ops): each
    Ctrl-C of ``overlap bench ops --backend mpi`` left both (fifty-seventh session), and the
    test suite's aborts had left 102 topology files over one day of runs (fifty-sixth)."""
    before = _hydra_files() | _mpich_segments()
    try:
        yield
    finally:
        left = (_hydra_files() | _mpich_segments()) - before
        # the ranks mpiexec killed can still be exiting, their segment mapped: a few seconds
        deadline = time.monotonic() + LEFTOVER_WAIT_S
        while left:
            held = _in_use(left)
            for path in left - held:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            left = held
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.1)


@contextlib.contextmanager
def terminate_as_exit() -> Iterator[None]:
    """SIGTERM (``kill``, a CI timeout, a launcher's stop) raises SystemExit in the main
    thread while inside, so that clean-up runs: a namespace is still removed, a
    ``RankPool`` stops its ranks and multiprocessing removes its folder in /tmp (``kill`` of
    ``overlap bench train`` left a ``pymp-*`` folder before: fifty-seventh session).
    SIGKILL cannot be caught, and a guardian process removes what was made then."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def stop_children(procs: list[subprocess.Popen[str]], ctrl_c: bool = True) -> None:
    """After an interrupt of this process: give ``procs`` :data:`CHILD_GRACE_S` (together)
    to end on their own, then SIGTERM and 5 s, then SIGKILL; SIGKILL at once on a second
    Ctrl-C. Their output is read (and dropped) meanwhile, so that a full pipe does not
    hold them up (:func:`run_child`).

    ``ctrl_c=False`` (SIGTERM to this process alone, or an error here): the children got
    nothing, so the SIGTERM comes at once. Before (fifty-seventh session), ``kill`` of
    ``overlap bench train --link 1gbit`` waited out the whole grace: 21 s to exit."""
    deadline = time.monotonic() + (CHILD_GRACE_S if ctrl_c else 0.0)
    try:
        for term in (False, True):
            for p in procs:
                if term and p.poll() is None:
                    with contextlib.suppress(OSError):
                        p.terminate()
            for p in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.communicate(timeout=max(deadline - time.monotonic(), 0.01))
            if all(p.poll() is not None for p in procs):
                return
            deadline = time.monotonic() + 5.0
    except KeyboardInterrupt:
        pass
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


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
