"""Shared fixtures: event-loop flavours for async tests, and reusable rank pools."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

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


@pytest.fixture(scope="session")
def short_pool() -> Iterator[RankPool]:
    """Two gloo ranks whose job timeout is SHORT_TIMEOUT seconds: for tests where a rank
    waits for a peer that stopped, and the backend's timeout is what ends the wait."""
    pool = RankPool(2, timeout=SHORT_TIMEOUT).start()
    yield pool
    pool.close()


_SHM = "/dev/shm"


def _regions(prefix: str) -> set[str]:
    try:
        return {f for f in os.listdir(_SHM) if f.startswith(prefix)}
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
def _no_leaked_mpich_regions() -> Iterator[None]:
    """Remove the MPICH shared-memory regions a test's MPI job left behind.

    MPICH unlinks ``/dev/shm/mpich_shm_*`` in ``MPI_Finalize``; the fault tests end ranks
    with ``os._exit`` or a kill, which skips it, and each such job left 2 MiB behind for
    good. Only regions that appeared during the test and that no living process maps are
    removed, so a concurrent MPI job is never touched."""
    before = _regions("mpich_shm_")
    yield
    new = _regions("mpich_shm_") - before
    if not new:
        return
    for name in new - _mapped(new):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(_SHM, name))


@pytest.fixture(autouse=True)
def _no_leaked_overlap_regions() -> Iterator[None]:
    """Fail a test after which a hierarchical reduction's shared region (``overlap-*``) is
    left in /dev/shm with no living process mapping it.

    Every rank of a host unlinks the region once it is mapped (or once making it failed), so
    a region outlives its ranks only when all of them died inside the few ms between making
    and unlinking it: no test does that, so a leftover is a bug. It is removed before the
    test fails, so one leak fails one test, not every later one."""
    before = _regions("overlap-")
    yield
    new = _regions("overlap-") - before
    if not new:
        return
    leaked = new - _mapped(new)
    for name in leaked:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(_SHM, name))
    if leaked:
        pytest.fail(f"shared regions left in {_SHM}: {sorted(leaked)}")
