"""Do the ranks of a group agree? The check a BucketScheduler or DiLoCo runs when built.

Every rank must build the same model (and, for DiLoCo, the same schedule), or the first
collective over mismatched buffers hangs or returns garbage. A few integers per rank (a
signature of the parameters' shapes and dtypes, the settings) are all-gathered once at
construction, and the ranks that differ from group rank 0 are named in the refusal.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import torch

from overlap import comm

__all__ = ["differing_ranks", "param_signature"]


def param_signature(params: Sequence[torch.Tensor]) -> int:
    """A checksum of the parameters' shapes and dtypes, in order."""
    return zlib.crc32(repr([(tuple(p.shape), str(p.dtype)) for p in params]).encode())


def differing_ranks(values: Sequence[int], group: Any, device: torch.device) -> list[int]:
    """The global ranks of ``group`` whose ``values`` differ from group rank 0's. A
    collective: every member calls it with as many values. ``device``: where the backend
    reduces (CUDA for NCCL)."""
    mine = torch.tensor(list(values), dtype=torch.int64, device=device)
    everyone = comm.all_gather(mine, group=group)
    return [
        comm.get_global_rank(group, i)
        for i, t in enumerate(everyone)
        if not torch.equal(t, everyone[0])
    ]
