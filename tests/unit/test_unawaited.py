"""Unawaited: a coroutine handed out and dropped before it ran is refused at the next call;
one awaited, gathered or kept as a task never is."""

from __future__ import annotations

import asyncio
import gc
import warnings

import pytest

from overlap.unawaited import Unawaited


class Stepper:
    """An object with an async step, wired as DiLoCo.astep is."""

    def __init__(self) -> None:
        self.steps = 0
        self.watch = Unawaited("the step did not happen")

    def astep(self) -> object:
        return self.watch.watch("thing.astep()", self._astep())

    async def _astep(self) -> None:
        self.watch.check()
        await asyncio.sleep(0)
        self.steps += 1


def test_a_dropped_step_is_refused_at_the_next_call_with_one_warning() -> None:
    s = Stepper()

    async def main() -> None:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            s.astep()  # the bug: no await
            gc.collect()
        assert [str(w.message) for w in seen] == ["coroutine 'thing.astep()' was never awaited"]
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with pytest.raises(RuntimeError, match=r"^thing.astep\(\) was called but never ran"):
                await s.astep()
            gc.collect()
        assert seen == []  # the refused call's own coroutine is closed, not left to warn
        await s.astep()  # reported once: the object goes on

    asyncio.run(main())
    assert s.steps == 1


def test_calls_kept_by_gather_or_a_task_are_never_flagged() -> None:
    s = Stepper()

    async def main() -> None:
        await asyncio.gather(s.astep(), s.astep(), s.astep())
        t1, t2 = asyncio.create_task(s.astep()), asyncio.create_task(s.astep())
        await asyncio.wait_for(s.astep(), 5)
        await t1
        await t2
        await s.astep()

    asyncio.run(main())
    assert s.steps == 7


def test_a_step_cancelled_before_it_began_counts_as_never_run() -> None:
    s = Stepper()

    async def main() -> None:
        t = asyncio.create_task(s.astep())
        t.cancel()
        await asyncio.wait([t])
        assert t.cancelled()
        del t  # the task held the coroutine
        gc.collect()
        with pytest.raises(RuntimeError, match="not awaited \\(or was cancelled before it began"):
            await s.astep()

    asyncio.run(main())
    assert s.steps == 0
