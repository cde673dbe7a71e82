"""Helpers the rank-side case modules share: record what each call raised; run a loop
that drops a coroutine on purpose."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Coroutine
from typing import Any

import overlap


def catcher(out: dict[str, str]) -> Callable[[str, Callable[[], Any]], None]:
    """``catch(name, fn)`` stores ``"Type: message"`` (or ``"no error"``) in ``out[name]``."""

    def catch(name: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
            out[name] = "no error"
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"

    return catch


def run_dropping(main: Coroutine[Any, Any, Any], remove: Callable[[], Any]) -> None:
    """``overlap.run(main)`` without Python's "never awaited" warnings (the loop drops a
    coroutine on purpose), then ``remove()`` whatever happened."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            overlap.run(main)
    finally:
        remove()
