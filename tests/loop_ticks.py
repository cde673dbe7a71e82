"""Count how often the running event loop gets to run another task: the proof that an awaited
op does not block the loop."""

from __future__ import annotations

import asyncio
from types import TracebackType


class LoopTicks:
    """``async with LoopTicks() as ticks: ...`` then ``ticks.count``: a task that increments
    ``count`` every time the loop schedules it, until the block ends."""

    def __init__(self) -> None:
        self.count = 0
        self._stop = False
        self._task: asyncio.Future[None] | None = None

    async def _tick(self) -> None:
        while not self._stop:
            self.count += 1
            await asyncio.sleep(0)

    async def __aenter__(self) -> LoopTicks:
        self._task = asyncio.ensure_future(self._tick())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop = True
        assert self._task is not None
        await self._task
