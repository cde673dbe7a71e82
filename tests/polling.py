"""Polling until something holds, for tests that watch another thread or process.

One helper instead of a deadline loop in each test: a condition polled every ``every``
seconds for at most ``within`` seconds. A test asserts the answer, so a condition that never
holds fails the test after ``within`` seconds instead of hanging it.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def until(check: Callable[[], object], within: float = 20.0, every: float = 0.05) -> bool:
    """Poll ``check`` until it is truthy or ``within`` seconds have passed; its last answer
    (checked once more at the deadline, so a condition that holds just then counts)."""
    end = time.monotonic() + within
    while not check():
        if time.monotonic() > end:
            return bool(check())
        time.sleep(every)
    return True
