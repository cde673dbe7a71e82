"""Shared fixtures: event-loop flavours for async tests, and reusable rank pools."""

from __future__ import annotations

import asyncio
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
