"""Shared fixtures: event-loop flavours for async tests, and reusable rank pools."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from overlap.bench.stopping import mpiexec_leftovers_removed
from overlap.runtime import new_event_loop, uvloop_available
from overlap.testing import RankPool

LOOP_KINDS = ["uvloop", "asyncio"] if uvloop_available() else ["asyncio"]


def pytest_asyncio_loop_factories(config: Any, item: Any) -> dict[str, Callable[[], Any]]:
    """Every async test runs once on uvloop and once on the default asyncio loop."""
    factories: dict[str, Callable[[], Any]] = {"asyncio": asyncio.new_event_loop}
    if uvloop_available():
        factories = {"uvloop": lambda: new_event_loop("uvloop"), **factories}
    return factories


@pytest.fixture(scope="session")
def pools() -> Iterator[Callable[[int], RankPool]]:
    """``pools(n)``: a pool of n gloo ranks, started once and reused for the whole session."""
    started: dict[int, RankPool] = {}

    def get(n: int) -> RankPool:
        pool = started.get(n)
        if pool is None:
            pool = started[n] = RankPool(n, timeout=120).start()
        return pool

    yield get
    for pool in started.values():
        pool.close()


SHORT_TIMEOUT = 5.0

# torch.amp.GradScaler (device "cpu") arrived in torch 2.3; overlap supports torch>=2.2
needs_amp_grad_scaler = pytest.mark.skipif(
    not hasattr(torch.amp, "GradScaler"),
    reason=f"torch {torch.__version__} has no torch.amp.GradScaler (torch 2.3 and later)",
)


@pytest.fixture(scope="session")
def short_pool() -> Iterator[RankPool]:
    """Two gloo ranks whose job timeout is SHORT_TIMEOUT seconds: for tests where a rank
    waits for a peer that stopped, and the backend's timeout is what ends the wait."""
    pool = RankPool(2, timeout=SHORT_TIMEOUT).start()
    yield pool
    pool.close()


_SHM = "/dev/shm"
_MPICH, _OURS = "mpich_shm_", "overlap-"


def _regions() -> set[str]:
    try:
        return {f for f in os.listdir(_SHM) if f.startswith((_MPICH, _OURS))}
    except OSError:
        return set()


def _mapped(names: set[str]) -> set[str]:
    """Those of ``names`` that some living process still maps or holds open."""
    held: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                text = maps.read()
        except OSError:
            continue
        held.update(n for n in names if n in text)
    return held


@pytest.fixture(autouse=True)
def _no_leaked_shm_regions() -> Iterator[None]:
    """Remove the shared-memory regions a test left in /dev/shm with no living process
    mapping them; fail the test when one of them is a hierarchical reduction's.

    MPICH unlinks ``/dev/shm/mpich_shm_*`` in ``MPI_Finalize``; the fault tests end ranks
    with ``os._exit`` or a kill, which skips it, and each such job left 2 MiB behind for
    good. Only regions that appeared during the test and that no living process maps are
    removed, so a concurrent MPI job is never touched.

    Every rank of a host unlinks an ``overlap-*`` region once it is mapped (or once making
    it failed), so one outlives its ranks only when all of them died inside the few ms
    between making and unlinking it: no test does that, so a leftover is a bug. It is
    removed before the test fails, so one leak fails one test, not every later one."""
    before = _regions()
    yield
    new = _regions() - before
    if not new:
        return
    orphans = new - _mapped(new)
    for name in orphans:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(_SHM, name))
    ours = sorted(n for n in orphans if n.startswith(_OURS))
    if ours:
        pytest.fail(f"shared regions left in {_SHM}: {ours}")


@pytest.fixture(scope="session", autouse=True)
def _no_mpich_leftovers_at_the_end() -> Iterator[None]:
    """At the end of the session, remove the ``/tmp/hydra_hwloc_xmlfile_*`` and
    ``/dev/shm/mpich_shm_*`` that appeared during it and that no living process holds,
    waiting up to 10 s for their holders to go (overlap.bench.stopping.mpiexec_leftovers_removed).

    MPICH leaves both at each ``MPI_Abort`` (the tests that check overlap aborts the job on
    an uncaught exception do that twice per run). The per-test sweep
    (:func:`_no_leaked_shm_regions`) leaves a segment that a rank still maps when its test
    ends, and a rank that a fault test killed (or whose launcher ``subprocess.run`` killed at
    its timeout) can still be exiting then: after a CI run one 2 MiB ``mpich_shm_*`` was
    left, written while the MPI tests ran, with no MPI process alive (fifty-fourth session).
    By the end of the session every rank the tests started is gone, so what is still held
    after the wait belongs to someone else's job."""
    with mpiexec_leftovers_removed(wait_s=10.0):
        yield
