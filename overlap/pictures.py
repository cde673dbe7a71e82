"""Where a picture goes: its path checked before the work that draws it, and the file
written whole.

Every picture overlap draws (``overlap trace plot``, ``bench train --plot``, ``bench lm
--plot``, the demo's timeline) comes at the end of a run that can take minutes. A path that
cannot be written used to fail only then, with matplotlib's traceback after the results;
a directory (``-o /tmp``) made matplotlib add ``.png`` and write ``/tmp.png`` while the
command said it wrote ``/tmp``. :func:`check_path` refuses those before anything runs (the
CLI calls it as an argparse type), and :func:`save` writes to a temporary file beside the
target and renames it, so an interrupted or failed save leaves no half-written picture and
an older picture at that path stays as it was.
"""

from __future__ import annotations

import os
from typing import Any

from overlap.files import write_whole

INSTALL_FIX = "pip install overlap[plot]"


def pyplot() -> Any:
    """matplotlib.pyplot on its file-only backend (Agg); ImportError with the fix when
    matplotlib is missing (it is the ``plot`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(f"plotting needs matplotlib: {INSTALL_FIX}") from exc
    return plt


def formats() -> list[str]:
    """The file suffixes matplotlib can write (png, svg, pdf, ...)."""
    pyplot()
    from matplotlib.backend_bases import FigureCanvasBase

    return sorted(FigureCanvasBase.get_supported_filetypes())


def check_path(path: str) -> str:
    """``path`` itself if a picture can be written there, else ValueError naming the problem
    and the fix: a directory, a suffix matplotlib cannot write (or none: it would add one),
    a folder that does not exist or is not writable, or no matplotlib at all."""
    if not path:
        raise ValueError("the picture's path is empty; give a file name such as timeline.png")
    if os.path.isdir(path):
        raise ValueError(
            f"{path!r} is a directory; give a file name in it, e.g. "
            f"{os.path.join(path, 'timeline.png')}"
        )
    try:
        known = formats()
    except ImportError as exc:
        raise ValueError(str(exc)) from None
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    if suffix not in known:
        what = f"suffix {'.' + suffix!r}" if suffix else "no suffix"
        raise ValueError(
            f"{path!r} has {what}; end the name with one of "
            f"{', '.join('.' + k for k in known)} (e.g. .png)"
        )
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"the folder of {path!r} does not exist; create {folder} first")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"the folder of {path!r} ({folder}) is not writable; choose another")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"{path!r} exists and is not writable; choose another name")
    return path


def save(fig: Any, path: str, dpi: int = 110) -> str:
    """Write ``fig`` to ``path`` whole (:func:`overlap.files.write_whole`) and close the
    figure, whatever happens. Returns ``path``. The path is checked first
    (:func:`check_path`: ValueError with the fix); on any error ``path`` is left as it was."""
    plt = pyplot()
    try:
        check_path(path)
        fmt = os.path.splitext(path)[1].lstrip(".").lower()
        write_whole(path, lambda f: fig.savefig(f, dpi=dpi, format=fmt), "the picture")
    finally:
        plt.close(fig)
    return path
