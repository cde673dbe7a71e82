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
from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.parameter import is_lazy

from overlap import comm
from overlap.comm.objects import _device
from overlap.comm.steps import Steps, run

__all__ = [
    "buffer_steps",
    "layout_error",
    "layout_signature",
    "layout_vote",
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


def layout_vote(named: Sequence[tuple[str, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """``[sig, -sig]`` of :func:`layout_signature`, to be MAX-reduced (alone, or at the end
    of a longer vote) and read with :func:`layouts_agree`."""
    sig = float(layout_signature(named))
    return torch.tensor([sig, -sig], dtype=torch.float32, device=device)


def layouts_agree(votes: torch.Tensor) -> bool:
    """Whether the ranks' signatures agree, from the last two entries of a MAX-reduced
    vote that ended ``[sig, -sig]`` on every rank: max(sig) == min(sig)."""
    return float(votes[-2]) == -float(votes[-1])


def buffer_steps(buffers: Sequence[torch.Tensor], group: Any = None) -> Steps:
    """The collectives that make ``buffers`` agree (module docstring), then the write-back,
    as a steps generator (overlap.comm.steps: ``run`` blocking, ``run_async`` awaited). A
    collective: every member of ``group`` calls it with buffers of the same layout, in the
    same order (check that first: :func:`layout_vote`)."""
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
    yield handles
    with torch.no_grad():
        for flat, group_buffers in flats:
            at = 0
            for b in group_buffers:
                b.copy_(flat[at : at + b.numel()].view(b.shape))
                at += b.numel()


def sync_steps(named: Sequence[tuple[str, torch.Tensor]], group: Any = None) -> Steps:
    """:func:`sync_buffers`' work as a steps generator: the layout vote, then
    :func:`buffer_steps`."""
    votes = layout_vote(named, _device())
    yield [comm.all_reduce(votes, op="max", group=group, async_op=True)]
    if not layouts_agree(votes):
        raise ValueError(layout_error(comm.get_all_ranks_from_group(group)))
    yield from buffer_steps([b for _, b in named], group)


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
