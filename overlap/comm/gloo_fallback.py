"""Ops an older torch's gloo lacks, built from ops it has.

gloo in torch 2.2 (measured on 2.2.2) refuses ``reduce_scatter`` of a list ("ProcessGroupGloo
does not support reduce_scatter"), ``all_to_all`` of lists ("Backend gloo does not support
alltoall") and an asynchronous ``reduce_scatter_tensor`` ("Gloo reduce_scatter_base fallback
not supported with async_op=True"); torch 2.13's gloo has all three. overlap supports
torch>=2.2, and deepspeed.comm users call these ops, so the torch backend tries the native op
first and, when torch refuses it as missing, records that and from then on issues:

- reduce_scatter: an all_reduce of the whole input (a copy: the user's input is left as it
  was), then this rank's chunk copied into the output. It moves about twice a ring
  reduce_scatter's bytes: right, not fast; upgrade torch for the native op.
- all_to_all: one ``all_to_all_single`` over the inputs' bytes laid end to end, with split
  sizes in bytes (so any mix of dtypes and shapes goes through), copied out into the outputs.

The refusal happens when the op is issued, before anything is sent, and every rank of a job
runs the same torch, so every rank switches at the same op and the group stays in step.

all_to_all of lists takes this path on every torch, not only where gloo lacks the op: gloo's
own takes lists whose tensors share one shape, so an uneven exchange (each rank sending each
peer its own number of rows, as MoE layers do) failed on gloo where MPI and NCCL ran it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["LACKING", "all_to_all", "lacks", "note_lacking", "reduce_scatter"]

log = logging.getLogger(__name__)

# the op kinds ("reduce_scatter", "reduce_scatter_flat") this torch's gloo refused as
# missing: issued through the fallbacks from then on (tests add to it to run them).
# all_to_all is not among them: on gloo it always takes its fallback (module docstring)
LACKING: set[str] = set()

Built = tuple[Callable[[], Any], Callable[[], object], Any]  # (issue, post, keep)


def lacks(exc: BaseException | None) -> bool:
    """Whether ``exc`` is torch saying its backend does not have the op at all."""
    said = str(exc)
    return "does not support" in said or "not supported with async_op" in said


def note_lacking(kind: str) -> None:
    """Record that this torch's gloo lacks ``kind`` (and say so once, at INFO)."""
    if kind not in LACKING:
        LACKING.add(kind)
        log.info(
            "torch %s's gloo has no %s: overlap issues it through ops gloo has from now on "
            "(overlap.comm.gloo_fallback; upgrade torch for the native op)",
            torch.__version__,
            kind,
        )


def reduce_scatter(
    out: torch.Tensor,
    chunks: Sequence[torch.Tensor] | torch.Tensor,
    op: Any,
    pg: Any,
    rank: int,
) -> Built:
    """reduce_scatter as an all_reduce of a copy of the input (a list of chunks, or one flat
    tensor of group-size x ``out``'s elements) and a copy of this rank's chunk into ``out``."""
    n = out.numel()
    if isinstance(chunks, torch.Tensor):
        buf = chunks.reshape(-1).clone()
    else:
        buf = torch.cat([c.reshape(-1) for c in chunks])
    mine = buf[rank * n : (rank + 1) * n].view(out.shape)
    return (
        lambda: dist.all_reduce(buf, op=op, group=pg, async_op=True),
        lambda: out.copy_(mine),
        buf,
    )


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def all_to_all(outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor], pg: Any) -> Built:
    """all_to_all of lists as one all_to_all_single of their bytes (split sizes in bytes),
    copied out into ``outs``."""
    send = torch.cat([_bytes(t) for t in ins])
    out_sizes = [t.numel() * t.element_size() for t in outs]
    recv = torch.empty(sum(out_sizes), dtype=torch.uint8)
    in_sizes = [t.numel() * t.element_size() for t in ins]

    def post() -> None:
        off = 0
        for t, k in zip(outs, out_sizes, strict=True):
            _bytes(t).copy_(recv[off : off + k])
            off += k

    return (
        lambda: dist.all_to_all_single(recv, send, out_sizes, in_sizes, group=pg, async_op=True),
        post,
        (send, recv),
    )
