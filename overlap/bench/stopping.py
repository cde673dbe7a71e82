"""How the CLI's processes stop: on Ctrl-C with one line and nothing left, on ``kill`` at
once and in order.

A Ctrl-C reaches every process of the terminal's group: the CLI, its benchmark children,
launchers (torchrun, mpiexec) and, where they share the group, ranks. The CLI says
``overlap: interrupted`` and exits 130; everything under it ends on its own, without a
word, and leaves nothing behind. A SIGTERM to the CLI alone (``kill``, a job scheduler)
reaches none of its children, so they are stopped at once. The pieces, each with the case
that asked for it (docs/reliability.md, "Ctrl-C of a command prints one line"):

* :func:`run_child` / :func:`stop_children`: a benchmark child gets time to end on its own
  after a Ctrl-C, none after a SIGTERM;
* :func:`python_module`: a child that prints nothing when a Ctrl-C stops it, also while it
  imports torch;
* :func:`interrupt_once`: a rank takes one interrupt and says nothing more;
* :func:`terminate_as_exit`: SIGTERM as an orderly exit, so that clean-up runs;
* :func:`mpiexec_leftovers_removed`: what MPICH leaves after an aborted job.

What outlives a SIGKILL is :mod:`overlap.bench.guard`'s. Standard library only.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

__all__ = [
    "CHILD_GRACE_S",
    "imports_held",
    "interrupt_once",
    "mpiexec_leftovers_removed",
    "python_module",
    "run_child",
    "stop_children",
    "terminate_as_exit",
]

F = TypeVar("F", bound=Callable[..., Any])


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
        stop_children([proc], exc)
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
    if m.startswith("overlap."):  # the package loads its names on first use
        importlib.import_module("overlap._preload")
finally:
    mask(signal.SIG_UNBLOCK, {signal.SIGINT})
runpy.run_module(m, run_name="__main__", alter_sys=True)
"""
# one line: launchers pass it on as an argument
_QUIET_MAIN = f"exec({_QUIET_SOURCE!r})"


def imports_held(*modules: str) -> None:
    """Import ``modules`` with SIGINT held (blocked), then take a Ctrl-C that came meanwhile:
    its KeyboardInterrupt is raised here, after the imports, not inside them.

    Why: an interrupt inside torch's or numpy's import broke it ("cannot load module more
    than once per process", or the process ended with "terminate called after throwing an
    instance of 'pybind11::error_already_set'"; fifty-seventh session), and a Ctrl-C in the
    first second of a command printed the import's traceback (fifty-eighth session). The
    main thread only: ``pthread_sigmask`` is per thread, and Python runs its signal handlers
    in the main thread."""
    import importlib

    held = threading.current_thread() is threading.main_thread() and hasattr(
        signal, "pthread_sigmask"
    )
    if held:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        for name in modules:
            importlib.import_module(name)
    finally:
        if held:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


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
def mpiexec_leftovers_removed(wait_s: float = LEFTOVER_WAIT_S) -> Iterator[None]:
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
        # the ranks mpiexec killed can still be exiting, their segment mapped: ``wait_s``
        deadline = time.monotonic() + wait_s
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


def stop_children(procs: list[subprocess.Popen[str]], stopped_by: BaseException) -> None:
    """Stop ``procs`` as this process leaves on ``stopped_by``. After a Ctrl-C (a
    KeyboardInterrupt: the children got it too), give them :data:`CHILD_GRACE_S` (together)
    to end on their own, then SIGTERM and 5 s, then SIGKILL; SIGKILL at once on a second
    Ctrl-C. Their output is read (and dropped) meanwhile, so that a full pipe does not hold
    them up (:func:`run_child`).

    Anything else (SIGTERM to this process alone, an error here): the children got nothing,
    so the SIGTERM comes at once. Before (fifty-seventh session), ``kill`` of ``overlap
    bench train --link 1gbit`` waited out the whole grace: 21 s to exit."""
    grace = CHILD_GRACE_S if isinstance(stopped_by, KeyboardInterrupt) else 0.0
    deadline = time.monotonic() + grace
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
