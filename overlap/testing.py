"""Run a function in N real processes joined in one gloo group: for tests and examples.

``spawn_ranks(fn, world_size)`` starts the ranks, runs ``fn`` on each (a coroutine function
runs on an event loop, uvloop by default) and returns each rank's result, in rank order.
``RankPool`` keeps the processes alive between calls, so a test suite pays the start-up
(importing torch, joining the group) once per world size instead of once per test.

If a rank raises, its exception is re-raised in the caller with the rank's traceback as
``__cause__``. If a rank dies or does not answer within ``timeout`` seconds, RankError says
which ranks, and the pool is torn down (the next call starts fresh processes): a hang fails
fast instead of stalling the suite. A rank that did not answer first writes every thread's
stack to stderr (faulthandler, on SIGUSR1), so a hang shows where it was.

``fn`` and its arguments are pickled, so ``fn`` must be importable (defined at module level).
A rank may start processes of its own (a DataLoader's workers). A pool left open is
stopped when it is collected or when the caller exits; and if the caller is killed (SIGKILL
included: a CI runner's timeout, the OOM killer), every rank ends within moments, whatever
it was doing (each watches a pipe whose other end only the caller holds).

Ranks are forked from multiprocessing's fork server (``start_method="forkserver"``, the
default where the platform has one), which imports torch and overlap once for the whole
process: a rank then starts in tens of milliseconds instead of paying torch's import (about
3 s of CPU each on a small machine), which is most of what a short multi-process test costs.
The server is a fresh interpreter, not a copy of the caller (no threads, no CUDA context,
no event loop are inherited), and each rank is given the caller's ``os.environ`` as it is
at ``start()``, so ranks see the environment a spawned process would. What only takes
effect when a process is exec'd (glibc's ``MALLOC_*``/``GLIBC_TUNABLES``, ``LD_PRELOAD``)
comes from the environment the server started with; ``start_method="spawn"`` starts every
rank as a fresh interpreter instead.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import multiprocessing as mp
import multiprocessing.util as mp_util
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from overlap.bench.guard import PARENT_GONE
from overlap.bench.hosts import Cluster, Host, namespace_hosts
from overlap.errors import RankError
from overlap.runtime import LoopKind

__all__ = ["Cluster", "Host", "RankPool", "RemoteTraceback", "namespace_hosts", "spawn_ranks"]

log = logging.getLogger(__name__)


class RemoteTraceback(Exception):
    """Carries a rank's formatted traceback as the ``__cause__`` of a re-raised error."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# what the fork server imports once, so that its ranks do not: torch and overlap's public
# names (overlap._preload: the package loads them on first use) and this module, whose
# _worker every rank runs; "__main__" as spawn would (a script's own functions stay
# importable by the ranks)
_PRELOAD = ["__main__", "overlap._preload", "overlap.testing"]
START_METHODS = ("forkserver", "spawn")


def _default_start_method() -> str:
    return "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


def _context(method: str) -> Any:
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # read once, when the server starts
    return ctx


@contextlib.contextmanager
def _ctrl_c_held() -> Iterator[None]:
    """Hold Ctrl-C back from this thread while it starts ranks: the processes it starts
    inherit the blocked signal (fork and exec keep a thread's signal mask), this thread
    gets a Ctrl-C that came meanwhile when it leaves the block, and each rank lets it
    through once it runs its own code (:func:`_worker`).

    Why: Ctrl-C reaches every process of the terminal's group. A rank started with spawn,
    or the fork server (which imports overlap and torch before it ignores SIGINT), that
    got it while importing printed a KeyboardInterrupt traceback (a Ctrl-C in the first
    seconds of ``overlap bench train``; fifty-seventh session), under the CLI's one line."""
    held = hasattr(signal, "pthread_sigmask")
    if held:
        from multiprocessing import resource_tracker

        # started on the way otherwise, it would unblock SIGINT after starting itself
        # (CPython's own guard of its start, bpo-33613): start it first
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        if held:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _exit_with_owner(lifeline: Connection) -> None:
    """Block until the pool's owner closes ``lifeline``'s other end, which the kernel does
    when the owner dies, however it dies; then end this rank at once.

    Why: a rank's parent is the fork server, not the pool's owner, and the fork server
    lives on while any rank does (each rank holds its liveness pipe), so nothing else told
    a rank that its owner was gone. Measured (fifty-sixth session): after ``kill -9`` of
    ``overlap bench ops``, its two ranks ran on at 60-70% of a core each, past 30 s, to
    the end of their loop; a test run killed at its timeout left its ranks the same way,
    or waiting in a collective for good. The owner closes its end only once the ranks
    have exited or been killed (:meth:`RankPool._kill`), so a polite ``close()`` is not
    cut short."""
    try:
        lifeline.recv_bytes()  # nothing is ever sent: this returns only at the end
    except (EOFError, OSError):
        pass
    os._exit(PARENT_GONE)  # the exit code of a process whose launcher is gone


def _worker(*args: Any) -> None:
    """A rank's process: :func:`_serve` (its arguments)."""
    try:
        _serve(*args)
    except KeyboardInterrupt:
        pass  # Ctrl-C before the rank was ready: the owner got it too and says so


def _serve(
    rank: int,
    world_size: int,
    port: int,
    conn: Connection,
    backend: str,
    env: dict[str, str],
    timeout: float,
    lifeline: Connection,
) -> None:
    if hasattr(signal, "pthread_sigmask"):  # held back while the rank started (_ctrl_c_held)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    # the caller's environment at start() and the pool's own: a forked rank would otherwise
    # have the fork server's, as it was when the server started
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import faulthandler
    import threading

    import torch

    threading.Thread(
        target=_exit_with_owner, args=(lifeline,), name="overlap-rank-lifeline", daemon=True
    ).start()

    # a hung rank's stacks, every thread's, on stderr: the pool asks for them before it
    # stops the ranks that did not answer in time (RankPool._collect)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.set_num_threads(1)
    from overlap.comm import debug, destroy_process_group, init_distributed

    # overlap was imported (to unpickle this function) before env was applied: read again
    debug.set_enabled(debug.env_enabled())
    from overlap.runtime import run

    try:
        init_distributed(dist_backend=backend, timeout=timeout)
    except BaseException as exc:
        conn.send(("err", _pack_error(exc)))
        return
    conn.send(("ready", None))
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            fn, args, kwargs, loop = msg
            try:
                out = fn(*args, **kwargs)
                if inspect.iscoroutine(out):
                    out = run(out, loop=loop)
                conn.send(("ok", out))
            except BaseException as exc:
                conn.send(("err", _pack_error(exc)))
    except (EOFError, KeyboardInterrupt):
        pass
    finally:
        destroy_process_group()


def _pack_error(exc: BaseException) -> tuple[BaseException | None, str, str]:
    import pickle

    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        pickle.dumps(exc)
        picklable: BaseException | None = exc
    except Exception:
        picklable = None
    return picklable, tb, f"{type(exc).__name__}: {exc}"


def _kill_procs(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


class RankPool:
    """``world_size`` long-lived rank processes in one group, reused across calls."""

    def __init__(
        self,
        world_size: int,
        *,
        backend: str = "gloo",
        timeout: float = 120.0,
        env: dict[str, str] | None = None,
        start_method: str | None = None,
    ) -> None:
        """``env``: set in every rank on top of the caller's environment (OMP_NUM_THREADS is
        1 unless given). ``start_method``: "forkserver" (the default where the platform has
        one) or "spawn"; the module's docstring says what differs."""
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        method = start_method or _default_start_method()
        if method not in START_METHODS or method not in mp.get_all_start_methods():
            have = [m for m in START_METHODS if m in mp.get_all_start_methods()]
            raise ValueError(
                f"start_method={start_method!r}: RankPool starts ranks with one of {have} "
                "(not 'fork': a copy of the caller would inherit its threads and locks)"
            )
        self.start_method = method
        self.world_size = world_size
        self.backend = backend
        self.timeout = timeout
        self.env = {"OMP_NUM_THREADS": "1", **(env or {})}
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._lifeline: Connection | None = None  # its end closes when this process dies
        self._finalizer: mp_util.Finalize | None = None

    # -------------------------------------------------------------------------- lifecycle
    def start(self) -> RankPool:
        if self._procs:
            return self
        ctx = _context(self.start_method)
        port = _free_port()
        env = {**os.environ, **self.env}
        # runs when the pool is collected, or at interpreter exit before multiprocessing
        # joins its non-daemonic children (exitpriority >= 0 runs first there): a pool left
        # open never holds up the caller's exit; it kills what this list holds by then
        self._finalizer = mp_util.Finalize(self, _kill_procs, args=(self._procs,), exitpriority=10)
        # each rank ends itself when this process is gone (_exit_with_owner)
        life_r, self._lifeline = ctx.Pipe(duplex=False)
        with _ctrl_c_held():
            self._start_ranks(ctx, port, env, life_r)
        life_r.close()
        self._collect("start-up", self.timeout)
        return self

    def _start_ranks(self, ctx: Any, port: int, env: dict[str, str], life_r: Connection) -> None:
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_worker,
                args=(
                    *(rank, self.world_size, port, child, self.backend, env, self.timeout),
                    life_r,
                ),
                name=f"overlap-rank-{rank}",
                # not daemonic, so a rank may start processes of its own (a DataLoader's
                # workers: "daemonic processes are not allowed to have children"); the
                # finalizer below stops ranks a caller left running, as the daemon flag did
                daemon=False,
            )
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)

    def close(self) -> dict[int, int | None]:
        """Stop the ranks (politely, then by force); return each rank's exit code, or None
        for a rank that had to be killed."""
        for c in self._conns:
            try:
                c.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 10
        for p in self._procs:
            p.join(timeout=max(deadline - time.monotonic(), 0.1))
        codes = {r: (None if p.is_alive() else p.exitcode) for r, p in enumerate(self._procs)}
        self._kill()
        return codes

    def _kill(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # kills what is left, once, and unregisters
            self._finalizer = None
        for c in self._conns:
            c.close()
        if self._lifeline is not None:
            self._lifeline.close()  # after the ranks: none is left to read its end
            self._lifeline = None
        self._procs, self._conns = [], []

    def __enter__(self) -> RankPool:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        """Close the pool; on the way out of a stop (SystemExit from ``kill``, Ctrl-C's
        KeyboardInterrupt) at once: the ranks are busy in the caller's function and would
        not read a polite stop for the 10 s :meth:`close` waits, past a launcher's patience
        (``kill`` of ``overlap bench ops``: 11 s to exit before, fifty-seventh session)."""
        if kind is not None and not issubclass(kind, Exception):
            self._kill()
            return
        self.close()

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    # -------------------------------------------------------------------------------- run
    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float | None = None,
        loop: LoopKind | None = None,
        expect_dead: Sequence[int] = (),
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        Ranks in ``expect_dead`` may die (fault-injection tests): their result is None and
        the call still waits for the others.
        """
        if not self.alive:
            self._kill()
            self.start()
        for c in self._conns:
            c.send((fn, args, kwargs, loop))
        return self._collect(
            getattr(fn, "__name__", repr(fn)), timeout or self.timeout, set(expect_dead)
        )

    def _dump_stacks(self, ranks: list[int]) -> None:
        """Ask each of ``ranks`` for its threads' stacks (faulthandler, on SIGUSR1; written
        to the rank's stderr, which is the caller's), and give them a moment to write, so
        that a hang is seen where it is before the ranks are stopped."""
        import signal

        asked = False
        for r in ranks:
            proc = self._procs[r]
            if proc.is_alive() and proc.pid is not None:
                try:
                    os.kill(proc.pid, signal.SIGUSR1)
                    asked = True
                except OSError:
                    pass
        if asked:
            time.sleep(1.0)

    def _collect(self, what: str, timeout: float, may_die: set[int] | None = None) -> list[Any]:
        pending = dict(enumerate(self._conns))
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs)}
        results: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                ranks = sorted(pending)
                self._dump_stacks(ranks)
                self._kill()
                raise RankError(
                    f"{what}: ranks {ranks} did not finish within {timeout:.0f} s (a hang or a "
                    "mismatched collective); the rank processes were stopped (their threads' "
                    "stacks are on stderr, from faulthandler)"
                )
            ready = wait([*pending.values(), *sentinels], timeout=left)
            for obj in ready:
                if obj in sentinels:
                    continue
                rank = next(r for r, c in pending.items() if c is obj)
                try:
                    results[rank] = self._conns[rank].recv()
                except (EOFError, OSError):
                    results[rank] = ("ok", None) if rank in (may_die or set()) else ("dead", None)
                del pending[rank]
            for r in [
                r
                for r in pending
                if r in (may_die or set())
                and not self._procs[r].is_alive()
                and not self._conns[r].poll()
            ]:
                results[r] = ("ok", None)
                del pending[r]
            dead = [r for r in pending if not self._procs[r].is_alive()]
            if dead:
                # Give a dying rank's pipe a moment to deliver a last message.
                time.sleep(0.05)
                if any(self._conns[r].poll() for r in dead):
                    continue
                codes = {r: self._procs[r].exitcode for r in dead}
                self._kill()
                raise RankError(f"{what}: rank(s) died without answering: exit codes {codes}")
        errors = {r: v for r, (kind, v) in results.items() if kind != "ok" and kind != "ready"}
        if errors:
            first = min(errors)
            if results[first][0] == "dead":
                self._kill()
                raise RankError(f"{what}: rank {first} closed its pipe without an answer")
            exc, tb, summary = errors[first]
            others = {
                r: (e[2] if e else "died without answering")
                for r, e in errors.items()
                if r != first
            }
            cause = RemoteTraceback(
                f"\n--- rank {first} traceback ---\n{tb}"
                + (f"\nother ranks failed too: {others}" if others else "")
            )
            if exc is None:
                raise RankError(f"{what} failed on rank {first}: {summary}") from cause
            raise exc from cause
        return [results[r][1] for r in range(len(self._conns))]


def spawn_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 120.0,
    loop: LoopKind | None = None,
    env: dict[str, str] | None = None,
    start_method: str | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` in ``world_size`` fresh processes; return their results."""
    pool = RankPool(
        world_size, backend=backend, timeout=timeout, env=env, start_method=start_method
    )
    with pool:
        return pool.run(fn, *args, timeout=timeout, loop=loop, **kwargs)
