"""Every rank starts from group rank 0's weights and buffers, as DDP makes it.

DDP broadcasts rank 0's parameters and buffers when it is built, so a job whose ranks seed
differently (or not at all) still trains one model; users coming from it rarely seed, and
DeepSpeed's engine does the same. A reducer that only averages gradients cannot repair a
different start: each rank applies the same averaged gradient to its own weights, the
ranks' models differ for ever, and every gradient is taken at weights the others do not
hold, with no error. So a :class:`~overlap.BucketScheduler` or a
:class:`~overlap.DiLoCo` built from a module takes group rank 0's parameters (frozen ones
too: a frozen layer initialised at random differs just the same) and buffers (BatchNorm's
running statistics, a step counter) at construction, once. Buffers are not re-sent at
each forward as DDP's ``broadcast_buffers=True`` does; docs/scheduler.md says how to keep
them equal.

The tensors are checked first by shape and dtype on every rank (``param_signature`` in the
reducer's one agreement check), so a broadcast never pairs tensors of other sizes. The
parameters are the ones :func:`overlap.params.select` already walked (tied ones once, lazy
ones refused): this module adds only the buffers.
"""

from __future__ import annotations

import torch

from overlap import comm
from overlap.buffer_sync import module_buffers
from overlap.params import Selection

__all__ = ["module_state", "broadcast_state"]


def module_state(
    model_or_params: torch.nn.Module | object, selection: Selection
) -> list[torch.Tensor]:
    """What the reducer broadcasts: every parameter of ``selection`` (the trainable ones,
    then the frozen ones) and, for a module, every buffer that has a shape (each once)."""
    out: list[torch.Tensor] = [*selection.params, *(p for _, p in selection.frozen)]
    if isinstance(model_or_params, torch.nn.Module):
        out += [b for _, b in module_buffers(model_or_params)]
    return out


def broadcast_state(
    state: list[torch.Tensor], group: object, device: torch.device, root: int = 0
) -> None:
    """Overwrite every tensor of ``state`` with group rank ``root``'s, in place. A collective:
    every member calls it with tensors of the same shapes and dtypes, in the same order.
    ``device``: where the backend moves data (CUDA for NCCL); a tensor elsewhere, or not
    contiguous (a channels_last weight), travels in a copy that is written back."""
    src = comm.get_global_rank(group, root)
    with torch.no_grad():
        for t in state:
            if t.numel() == 0:
                continue
            data = t.detach()
            if data.is_contiguous() and data.device == device:
                comm.broadcast(data, src=src, group=group)
                continue
            moved = data.to(device).contiguous()
            comm.broadcast(moved, src=src, group=group)
            data.copy_(moved)
