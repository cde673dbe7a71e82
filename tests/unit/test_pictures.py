"""overlap.pictures: a picture's path is refused before the work, and the file is written
whole or not at all."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from overlap.pictures import check_path, pyplot, save

pytest.importorskip("matplotlib")


def test_paths_that_cannot_take_a_picture_are_refused_with_the_fix(tmp_path: Path) -> None:
    assert check_path(str(tmp_path / "t.png")) == str(tmp_path / "t.png")
    assert check_path(str(tmp_path / "t.SVG"))  # matplotlib reads suffixes in any case
    for path, says in (
        (str(tmp_path), "is a directory; give a file name in it, e.g. "),
        (str(tmp_path / "t"), "has no suffix; end the name with one of "),
        (str(tmp_path / "t.txt"), "has suffix '.txt'; end the name with one of "),
        (str(tmp_path / "missing" / "t.png"), "does not exist; create "),
        ("", "the picture's path is empty"),
    ):
        with pytest.raises(ValueError, match=says):
            check_path(path)
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="is not writable"):
            check_path(str(locked / "t.png"))


def _figure() -> object:
    fig, ax = pyplot().subplots(figsize=(2, 2))
    ax.plot([0, 1], [1, 0])
    return fig


def test_save_writes_the_picture_whole_with_the_usual_mode(tmp_path: Path) -> None:
    out = tmp_path / "t.png"
    assert save(_figure(), str(out)) == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~umask  # not mkstemp's 0600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.png"]  # no temporary left


def test_a_failed_save_leaves_the_old_picture_and_no_temporary(tmp_path: Path) -> None:
    """Before, savefig wrote into the target directly: a save that failed half-way left a
    truncated picture where the previous one was."""
    out = tmp_path / "t.png"
    out.write_bytes(b"the previous picture")
    fig = _figure()

    def broken(*args: object, **kwargs: object) -> None:
        f = args[0]
        f.write(b"half a picture")  # type: ignore[attr-defined]
        raise RuntimeError("the renderer failed")

    fig.savefig = broken  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="the renderer failed"):
        save(fig, str(out))
    assert out.read_bytes() == b"the previous picture"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.png"]
    with pytest.raises(ValueError, match="is a directory"):
        save(_figure(), str(tmp_path))
    assert not Path(str(tmp_path) + ".png").exists()  # matplotlib would have written DIR.png
