"""Files written whole: a temporary file beside the target, then a rename.

A trace (:mod:`overlap.trace.chrome`) or a picture (:mod:`overlap.pictures`) comes at the
end of a run; a write that fails half-way (a full disk, an interrupt, a renderer's error)
must not leave a truncated file where the user looks, nor destroy the previous one.
:func:`write_whole` gives both: the target is replaced only by a file that was written to
the end, and the temporary file is removed on any error.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import IO


def cannot_write(path: str, what: str) -> OSError | None:
    """Why :func:`write_whole` would fail before writing a byte (``path`` a directory, its
    folder missing or not writable), as the error it would raise; None when nothing says
    so. For a collective write: the writing rank checks before the others send it their
    part, so that every rank can raise, not the writer alone."""
    if not path:
        return FileNotFoundError(
            f"cannot write {what} to an empty path; pass a file path such as trace.json"
        )
    target = os.path.abspath(path)
    if os.path.isdir(target):
        return IsADirectoryError(
            f"cannot write {what} to {path}: it is a directory; pass a file path such as "
            f"{os.path.join(path, 'trace.json')}"
        )
    folder = os.path.dirname(target)
    if not os.path.isdir(folder):
        return FileNotFoundError(
            f"cannot write {what} to {path}: no such directory {folder}; choose a writable "
            "directory"
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        return PermissionError(
            f"cannot write {what} to {path}: permission denied in {folder}; choose a "
            "writable directory"
        )
    return None


def write_whole(path: str, write: Callable[[IO[bytes]], object], what: str) -> None:
    """Call ``write`` on a temporary file in ``path``'s folder, then rename it to ``path``
    with the mode a plain ``open`` would give it. ``what`` names the file in the error when
    the folder cannot take a new file (OSError with the fix). ``path`` is left as it was when
    anything fails."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".overlap-", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise OSError(
            f"cannot write {what} to {path}: {exc.strerror}; choose a writable directory"
        ) from exc
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp makes 0600; these are ordinary files
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def umask() -> int:
    """The process's umask, read from /proc/self/status: setting it to read it back would
    change it for a moment under every other thread. 0o022 where that file has no line."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022
