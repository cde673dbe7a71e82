"""A user's compressor's ``reduce_steps``, checked in one process (no job): a plain function
and a phase that is not a list of handles are TypeErrors naming the fix. Through the
BucketScheduler both hung every rank before (found by trying it)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from overlap.comm.handle import Handle
from overlap.compression.base import Compressor, steps_of


class Mine(Compressor):
    name = "mine"
    summable = True

    def __init__(self, phase: Any = None, generator: bool = True) -> None:
        self.phase, self.generator = phase, generator

    def reduce_steps(self, key: Any, flat: torch.Tensor, **kw: Any) -> Any:  # type: ignore[override]
        if not self.generator:
            return flat
        return self._steps(flat)

    def _steps(self, flat: torch.Tensor) -> Any:
        got = yield self.phase
        assert got is None
        return flat


def drive(steps: Any) -> Any:
    try:
        while True:
            steps.send(None)
    except StopIteration as stop:
        return stop.value


def test_a_plain_function_is_named_with_the_generator_to_write() -> None:
    c = Mine(generator=False)
    with pytest.raises(TypeError, match=r"^Mine\.reduce_steps returned Tensor, not a generator"):
        steps_of(c, c.reduce_steps("k", torch.ones(2)))


@pytest.mark.parametrize(
    ("phase", "named"),
    [(Handle.completed("x", None), "Handle"), (None, "NoneType"), ([42], "a list holding int")],
)
def test_a_phase_that_is_not_a_list_of_handles_is_named(phase: Any, named: str) -> None:
    c = Mine(phase)
    with pytest.raises(TypeError, match=f"^Mine.reduce_steps yielded {named}: each phase"):
        drive(steps_of(c, c.reduce_steps("k", torch.ones(2))))


def test_good_phases_pass_through_with_the_result() -> None:
    flat = torch.ones(2)
    for phase in ([], [Handle.completed("x", None)], (Handle.completed("x", None),)):
        c = Mine(phase)
        assert drive(steps_of(c, c.reduce_steps("k", flat))) is flat
