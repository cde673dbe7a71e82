"""Argument checks shared by the backends. Each error names the problem and the fix.

Checks run before anything is sent, so a bad call fails on the rank that made it and leaves
every tensor untouched. (A bad call made on *all* ranks therefore fails on all of them; a call
made on one rank only is the mismatch that the debug mode of the reliability work catches.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["check_peer", "check_tensor", "check_tensor_list", "nbytes_of"]


def check_tensor(t: Any, name: str, device_type: str, backend: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_sparse:
        raise TypeError(f"{name} is a sparse tensor; pass a dense tensor (t.to_dense())")
    if not t.is_contiguous():
        raise ValueError(
            f"{name} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); pass "
            f"{name}.contiguous() and copy the result back if you need it in place"
        )
    if t.device.type != device_type:
        hint = ".cpu()" if device_type == "cpu" else ".cuda()"
        raise ValueError(
            f"{name} is on {t.device} but the {backend} backend works on {device_type} tensors; "
            f"move it with {name}{hint}, or initialise a backend for {t.device.type} tensors"
        )
    return t


def check_tensor_list(
    ts: Any, name: str, device_type: str, backend: str, length: int | None = None
) -> list[torch.Tensor]:
    if isinstance(ts, torch.Tensor) or not isinstance(ts, Sequence):
        raise TypeError(f"{name} must be a list of tensors, got {type(ts).__name__}")
    if length is not None and len(ts) != length:
        raise ValueError(
            f"{name} has {len(ts)} tensors but the group has {length} ranks; "
            f"pass exactly one tensor per rank"
        )
    for i, t in enumerate(ts):
        check_tensor(t, f"{name}[{i}]", device_type, backend)
    # Hand back the caller's own list: results and in-place outputs must be *their* objects.
    return ts if isinstance(ts, list) else list(ts)


def check_peer(rank: int, what: str, group_ranks: Sequence[int], group_name: str) -> None:
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise TypeError(f"{what} must be an int (a global rank), got {type(rank).__name__}")
    if rank not in group_ranks:
        raise ValueError(
            f"{what}={rank} is not a rank of group {group_name} (its global ranks are "
            f"{list(group_ranks)}); pass the global rank of a group member"
        )


def nbytes_of(*tensors: torch.Tensor | Sequence[torch.Tensor] | None) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
        else:
            total += sum(x.numel() * x.element_size() for x in t)
    return total
