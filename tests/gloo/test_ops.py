"""Every op, blocking, waited and awaited (uvloop and asyncio), at world sizes 1 to 4."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from overlap.testing import RankPool
from tests.gloo import cases

MODES = ["blocking", "wait", "uvloop", "asyncio"]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(cases.CASES))
def test_op(pools: Callable[[int], RankPool], world_size: int, mode: str, case: str) -> None:
    assert pools(world_size).run(cases.run_case, case, mode, timeout=60) == [case] * world_size
