"""The package loads its public names on first use: the same objects as the modules' own,
every name of ``__all__`` there, and nothing heavy at ``import overlap`` or ``--help``."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import overlap

INIT = Path(overlap.__file__)


def _static_imports() -> dict[str, tuple[str, str | None]]:
    """The names the TYPE_CHECKING block imports: name -> (module, its name there), or
    (module, None) for a module imported from its package."""
    tree = ast.parse(INIT.read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If))
    out: dict[str, tuple[str, str | None]] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names:
            name = alias.asname or alias.name
            if node.module == "overlap":
                out[name] = (f"overlap.{alias.name}", None)
            else:
                out[name] = (node.module, alias.name)
    return out


def test_the_lazy_table_is_what_static_tools_see() -> None:
    assert _static_imports() == overlap._WHERE
    assert set(overlap._WHERE) == set(overlap.__all__) - {"__version__"}


@pytest.mark.parametrize("name", sorted(set(overlap.__all__) - {"__version__"}))
def test_each_name_is_the_modules_own_object(name: str) -> None:
    module, attr = overlap._WHERE[name]
    m = importlib.import_module(module)
    assert getattr(overlap, name) is (m if attr is None else getattr(m, attr))
    assert name in dir(overlap)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'BucketSchedular'"):
        overlap.BucketSchedular  # noqa: B018
    with pytest.raises(ImportError, match="BucketSchedular"):
        exec("from overlap import BucketSchedular", {})


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return set(out.stdout.split())


def test_import_overlap_and_the_cli_load_no_torch() -> None:
    """``import overlap`` and the CLI's module import no torch: ``overlap --help`` took
    1.5-2 s, all of it torch's import (fifty-eighth session)."""
    assert "torch" not in _modules_after("import overlap, overlap.cli")
    loaded = _modules_after("import overlap._preload")
    assert {"torch", "overlap.comm", "overlap.scheduler", "overlap.optim"} <= loaded


def test_help_and_a_bad_argument_answer_without_torch() -> None:
    code = (
        "import sys\n"
        "from overlap.cli import main\n"
        "for argv in (['--help'], ['bench', 'train', '--steps', 'x']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as e:\n"
        "        print('exit', e.code, file=sys.stderr)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code + "print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip().endswith("False"), out.stdout[-500:]
    assert "exit 0" in out.stderr and "exit 2" in out.stderr, out.stderr[-2000:]
    assert "argument --steps: 'x' is not an integer" in out.stderr
