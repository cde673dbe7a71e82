"""Checkpoints that hold one rank's own state: loaded by that rank only.

Error feedback (OneBit's worker and server errors, PowerSGD's error and factors, Int8's
residuals) is each rank's own: it is what that rank's compression left out, and a server
error is for that rank's chunk. A common checkpointing habit, ``if rank == 0:
torch.save(sched.state_dict(), path)`` and then every rank loading ``path``, gave every
rank rank 0's errors, which would then compensate the wrong residuals, with no error. So a
state that holds such tensors records the rank that saved it (its rank in the holder's
group), and a load on another rank is refused before anything changes. A state with no
tensors in it (no compression, fp16 casts) is the same on every rank and loads anywhere;
a state saved before the rank was recorded is not checked.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_rank", "group_rank", "holds_tensors"]


def group_rank(group: Any) -> int | None:
    """This process's rank in ``group``; None when no job is initialized (one process)."""
    from overlap import comm

    return comm.get_rank(group) if comm.is_initialized() else None


def holds_tensors(state: Any) -> bool:
    """Whether ``state`` (nested dicts, lists and tuples) holds a tensor anywhere."""
    if isinstance(state, torch.Tensor):
        return True
    if isinstance(state, dict):
        return any(holds_tensors(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return any(holds_tensors(v) for v in state)
    return False


def check_rank(what: str, saved: Any, mine: int | None, per_rank: Any) -> None:
    """ValueError when ``per_rank`` (the rank-local part of a state) holds tensors and was
    saved by group rank ``saved`` rather than ``mine`` (None for either: not checked)."""
    if saved is None or mine is None or int(saved) == mine or not holds_tensors(per_rank):
        return
    raise ValueError(
        f"this {what} state was saved by rank {saved} of its group, and this is rank {mine}: "
        "its compression error feedback is the saving rank's own (what that rank's "
        "compression left out), so it would compensate the wrong residuals here. Save every "
        "rank's state (e.g. torch.save(x.state_dict(), f'ckpt-rank{rank}.pt')) and load "
        "each rank its own; nothing was changed"
    )
