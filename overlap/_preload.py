"""Importing this module loads every public name of ``overlap`` (torch with them): what
``import overlap`` did before the package loaded its names on first use.

Why a module: a fork server preloads modules by name (:mod:`overlap.testing`'s ranks are
forked from one that has imported torch once), and the CLI and its children import it with
Ctrl-C held (:func:`overlap.bench.stopping.imports_held`), since an interrupt inside torch's
or numpy's import broke them.
"""

from __future__ import annotations

import overlap

for _name in overlap.__all__:
    getattr(overlap, _name)
