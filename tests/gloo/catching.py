"""A helper the rank-side case modules share: record what each call raised."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def catcher(out: dict[str, str]) -> Callable[[str, Callable[[], Any]], None]:
    """``catch(name, fn)`` stores ``"Type: message"`` (or ``"no error"``) in ``out[name]``."""

    def catch(name: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
            out[name] = "no error"
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"

    return catch
