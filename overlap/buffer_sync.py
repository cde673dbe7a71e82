"""Make every rank's buffers agree: floating-point ones averaged over a group, the others
group rank 0's.

A BucketScheduler averages gradients and a DiLoCo averages weights; neither re-sends
buffers at each step (DDP's ``broadcast_buffers``), so each rank's BatchNorm running
statistics follow its own batches. Before evaluating, saving, or ending a DiLoCo run on
one model, they must agree. Averaging is what ``timm``'s ``distribute_bn(reduce=True)``
does for running statistics: every rank's batches count, where taking rank 0's drops the
others'. A buffer that is not floating point (BatchNorm's ``num_batches_tracked``, a step
counter) cannot be averaged and is taken from group rank 0.

:func:`sync_buffers` is the call; :meth:`overlap.DiLoCo.finish` makes it too, so that
"every rank ends on the same model" holds for a model with BatchNorm (before the
forty-third session the parameters agreed after ``finish()`` and the running statistics
did not: each rank evaluated its own model).

The buffers travel coalesced: one all-reduce per floating dtype and device, one broadcast
per other dtype and device, so a ResNet's hundreds of small buffers cost a few collectives.
The ranks' buffer layouts (names, shapes, dtypes) are checked against each other first
(:func:`layout_signature`), and a difference raises ValueError on every rank with nothing
changed: a collective over buffers of other sizes would pair the wrong bytes or hang.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn.parameter import is_lazy

from overlap import comm
from overlap.comm.steps import Steps, run

__all__ = [
    "issue_buffer_sync",
    "layout_error",
    "layout_signature",
    "layouts_agree",
    "module_buffers",
    "sync_buffers",
    "sync_steps",
]

# the signature rides in a float32 vote (DiLoCo.finish), which holds integers below 2**24
# exactly
_SIG_MOD = 1 << 23


def module_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers :func:`sync_buffers` makes agree: every named buffer with a shape, each
    once, in ``named_buffers()`` order."""
    return [(n, b) for n, b in model.named_buffers() if not is_lazy(b)]


def layout_signature(named: Sequence[tuple[str, torch.Tensor]]) -> int:
    """A checksum of the buffers' names, shapes and dtypes, in [0, 2**23): the same on
    every rank exactly when their layouts agree (up to a checksum's collisions)."""
    sig = repr([(n, tuple(b.shape), str(b.dtype)) for n, b in named]).encode()
    return zlib.crc32(sig) % _SIG_MOD


def layouts_agree(votes: torch.Tensor) -> bool:
    """Whether the ranks' signatures agree, from the last two entries of a MAX-reduced
    vote that ended ``[sig, -sig]`` on every rank: max(sig) == min(sig)."""
    return float(votes[-2]) == -float(votes[-1])


def issue_buffer_sync(
    buffers: Sequence[torch.Tensor], group: Any = None
) -> tuple[list[Any], Callable[[], None]]:
    """Issue the collectives that make ``buffers`` agree (module docstring) and return
    their handles and the write-back to call once every handle has completed. A
    collective: every member of ``group`` calls it with buffers of the same layout, in the
    same order (check it first: :func:`layout_signature`)."""
    src = comm.get_global_rank(group, 0)
    nccl = comm.get_backend() == "nccl"
    by_kind: dict[tuple[bool, torch.dtype, torch.device], list[torch.Tensor]] = {}
    for b in buffers:
        if b.numel():
            by_kind.setdefault((b.is_floating_point(), b.dtype, b.device), []).append(b)
    handles, flats = [], []
    for (floating, _, device), group_buffers in by_kind.items():
        with torch.no_grad():
            flat = torch.cat([b.detach().reshape(-1) for b in group_buffers])
            if nccl and device.type != "cuda":
                flat = flat.cuda()
        if floating:
            handles.append(comm.all_reduce(flat, op="avg", group=group, async_op=True))
        else:
            handles.append(comm.broadcast(flat, src=src, group=group, async_op=True))
        flats.append((flat, group_buffers))

    def write_back() -> None:
        with torch.no_grad():
            for flat, group_buffers in flats:
                at = 0
                for b in group_buffers:
                    b.copy_(flat[at : at + b.numel()].view(b.shape))
                    at += b.numel()

    return handles, write_back


def sync_steps(named: Sequence[tuple[str, torch.Tensor]], group: Any = None) -> Steps:
    """:func:`sync_buffers`' work as a steps generator (overlap.comm.steps): the layout
    vote, then the coalesced collectives, then the write-back; driven blocking with
    ``run`` or awaited with ``run_async``."""
    sig = float(layout_signature(named))
    nccl = comm.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    votes = torch.tensor([sig, -sig], dtype=torch.float32, device=device)
    yield [comm.all_reduce(votes, op="max", group=group, async_op=True)]
    if not layouts_agree(votes):
        raise ValueError(layout_error(comm.get_all_ranks_from_group(group)))
    handles, write_back = issue_buffer_sync([b for _, b in named], group)
    yield handles
    write_back()


def sync_buffers(model: torch.nn.Module, group: Any = None) -> None:
    """Average ``model``'s floating-point buffers over ``group`` (the world by default) and
    give every rank group rank 0's other buffers, in place (module docstring).

    A collective: every member of ``group`` calls it. Raises ValueError on every rank, with
    nothing changed, when the ranks' buffers differ in name, shape or dtype. Typical use:
    before evaluating or saving with BatchNorm running statistics trained under a
    BucketScheduler (:meth:`overlap.DiLoCo.finish` calls it itself)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"sync_buffers takes a torch.nn.Module, got {type(model).__name__}")
    run(sync_steps(module_buffers(model), group))


def layout_error(ranks: Sequence[int]) -> str:
    """The refusal when the ranks' buffer layouts differ."""
    return (
        f"the ranks {list(ranks)} hold buffers of different names, shapes or dtypes (a module "
        "added or changed on some ranks only): nothing was changed; build the same model on "
        "every rank"
    )
