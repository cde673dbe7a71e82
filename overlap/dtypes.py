"""dtypes that only some torch releases have.

overlap supports torch 2.2 and later; the unsigned 16/32/64-bit dtypes arrived in torch
2.3 and the float8 family grows release by release. Code that names such a dtype at import
time (a table of what a backend refuses, or how it aliases a dtype for NumPy) takes it from
here, so that ``import overlap`` works on every supported torch: on torch 2.2 a bare
``torch.uint16`` raised AttributeError at import.
"""

from __future__ import annotations

import torch

__all__ = ["float8_dtypes", "present"]


def present(*names: str) -> list[torch.dtype]:
    """The dtypes among ``names`` (``"uint16"``, ...) that this torch has, in that order."""
    found = (getattr(torch, n, None) for n in names)
    return [d for d in found if isinstance(d, torch.dtype)]


def float8_dtypes() -> list[torch.dtype]:
    """Every float8 dtype this torch has (``float8_e4m3fn``, ``float8_e5m2``, ...)."""
    return present(*sorted(n for n in dir(torch) if n.startswith("float8_")))
