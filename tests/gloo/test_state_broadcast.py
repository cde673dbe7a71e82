"""overlap.broadcast_parameters / broadcast_optimizer_state on 3 real gloo ranks
(tests/gloo/state_broadcast_cases.py; the same checks run under mpiexec)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from overlap.testing import RankPool
from tests.gloo import state_broadcast_cases as sb


@pytest.mark.parametrize("check", list(sb.CHECKS))
def test_state_broadcast(pools: Callable[[int], RankPool], check: str) -> None:
    assert pools(3).run(sb.CHECKS[check], timeout=120) == [None] * 3
