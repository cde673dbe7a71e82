"""Inputs that share memory with their op's outputs: copied first, so the result is right.

torch lets a collective's input and output be views of one buffer: ZeRO gathers each
rank's partition into the flat buffer it is a view of (``all_gather_into_tensor(flat,
flat.narrow(0, rank * n, n))``). What the backends make of it, measured with 2 ranks
(torch 2.13, MPICH 4):

* gloo ``all_to_all_single`` with an output that overlaps the input in part: a wrong
  result on one rank (it sent bytes it had already overwritten), no error;
* gloo list ``reduce_scatter`` whose output is one of the inputs: a wrong sum, no error;
* gloo ``scatter`` whose source's output is the part it sends another rank: that rank got
  the overwritten part about half the time (gloo lands the source's own part first);
* MPI ``all_gather_into_tensor``, ``reduce_scatter`` and ``all_to_all_single`` with the
  input a view of the output: ``Invalid buffer pointer`` from MPICH, on the ranks whose
  pointers it finds aliased, while the others went on into the collective and hung.

So when an input's bytes overlap an output's, the op sends a copy of the input, taken at
the call (when the op is issued, as every op's data is). It costs one copy of the input,
and only when they overlap: two pointer comparisons per op otherwise. Left alone are the
two forms NCCL documents as in place (an all-gather's input at its rank's slot of the
output, a reduce-scatter's output at its rank's slot of the input), on CUDA tensors, where
a copy would cost device memory for nothing (not yet run on a GPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["apart", "apart_list"]


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges of contiguous ``a`` and ``b`` overlap (0.24 us; an empty
    tensor inside the other's range counts, and costs an empty copy)."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return not (a0 + a.nbytes <= b0 or b0 + b.nbytes <= a0)


def apart(inp: torch.Tensor, out: torch.Tensor, nccl_in_place: int | None = None) -> torch.Tensor:
    """``inp``, or a copy of it when its memory overlaps ``out``'s.

    ``nccl_in_place``: the byte offset of ``inp`` from ``out`` (negative: of ``out`` from
    ``inp``) that NCCL runs in place; a CUDA input exactly there is not copied."""
    if not _overlap(inp, out):  # the common case: one call
        return inp
    if nccl_in_place is not None and inp.is_cuda:
        offset = inp.data_ptr() - out.data_ptr()
        if offset == nccl_in_place:
            return inp
    return inp.clone()


def apart_list(ins: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``ins``, with every input copied if any of them overlaps any output.

    A first pass compares storages (one set lookup per input), the exact byte ranges only
    where an input shares a storage with an output."""
    stores = {o.untyped_storage().data_ptr() for o in outs}
    shared = [i for i in ins if i.untyped_storage().data_ptr() in stores]
    if shared and any(_overlap(i, o) for i in shared for o in outs):
        return [i.clone() for i in ins]
    return list(ins)
