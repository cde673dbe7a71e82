"""The product of complex tensors on torch's backends, from a gather and a local fold.

torch.distributed reduces a complex tensor as its real pairs: right for a sum or an
average, wrong for a product ((a + bi)(c + di) is not (ac, bd)). So torch refuses it:
``all_reduce`` with a ValueError, ``reduce`` with a RuntimeError from the process group.
MPI multiplies complex numbers itself, and overlap's ring and naive allreduce do it in
Python. Before this module, the same ``all_reduce(t, "product")`` on a complex tensor gave
the product on MPI and raised on gloo, ``reduce`` raised a CommError that told the user to
upgrade torch, and ``reduce_scatter`` raised torch's all_reduce message (found by a
differential fuzz against a per-rank reference, forty-sixth session).

Here every rank's values are moved as real pairs (an all-gather; for a reduce-scatter, an
all-to-all of the chunks, so each rank gets only the chunks it reduces), and each rank
multiplies them in rank order. Every rank folds the same numbers in the same order, so the
results agree bit for bit across ranks. It moves ``world`` times the tensor where a native
reduction would move about twice: a product of complex tensors is rare, and a right answer
is the point.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["fold_into", "gather_issue", "scatter_issue"]


def fold_into(pieces: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` = pieces[0] * pieces[1] * ... in that order (dim 0 indexes the ranks)."""
    acc = pieces[0].clone()
    for k in range(1, pieces.shape[0]):
        acc.mul_(pieces[k])
    out.copy_(acc.reshape(out.shape))


def gather_issue(t: torch.Tensor, pg: Any, world: int, gather: Any) -> tuple[Any, torch.Tensor]:
    """(the call that gathers every rank's ``t`` as real pairs with ``gather``, torch's
    all_gather_single or all_gather_into_tensor, and the (world, n) complex buffer it
    fills). ``t`` is copied first: the caller's tensor may be written by the fold
    while a slower rank's gather still reads this rank's values."""
    mine = t.detach().reshape(-1).clone()
    flat = torch.empty(world * mine.numel(), dtype=t.dtype, device=t.device)

    def issue() -> Any:  # gloo takes the gathered output flat only
        return gather(torch.view_as_real(flat), torch.view_as_real(mine), group=pg, async_op=True)

    return issue, flat.view(world, -1)


def scatter_issue(chunks: torch.Tensor, pg: Any, world: int) -> tuple[Any, torch.Tensor]:
    """(the call that sends chunk j of ``chunks`` (world, n) to rank j and receives every
    rank's chunk for this rank, the (world, n) complex buffer it fills)."""
    send = chunks.detach().reshape(world, -1).contiguous()
    pieces = torch.empty_like(send)

    def issue() -> Any:
        return dist.all_to_all_single(
            torch.view_as_real(pieces), torch.view_as_real(send), group=pg, async_op=True
        )

    return issue, pieces
