"""Coalesced collectives: several tensors in one collective per dtype and device.

``all_reduce_coalesced`` flattens the tensors of each (dtype, device) into one buffer,
all-reduces it, and copies the results back; ``all_gather_coalesced`` does the same with one
all_gather_into_tensor. One collective instead of one per tensor: each op's fixed cost is
paid once (DeepSpeed uses them for many small tensors, as ZeRO's partitions).

Both are steps generators (:mod:`overlap.comm.steps`): blocking, they run here; with
``async_op=True`` they run to the end on the group's driver thread, so the copy back happens
whatever is done with the Handle.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from overlap.comm.steps import Steps
from overlap.comm.validate import check_distinct

__all__ = ["all_gather_coalesced_steps", "all_reduce_coalesced_steps", "check_tensors"]


def check_tensors(name: str, tensors: Any) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name} must be a list of tensors, got {type(tensors).__name__}")
    bad = [i for i, t in enumerate(tensors) if not isinstance(t, torch.Tensor)]
    if bad:
        raise TypeError(f"{name}[{bad[0]}] is a {type(tensors[bad[0]]).__name__}, not a tensor")
    # the caller's own list is the result, as the other list collectives' (a tuple: a list)
    return tensors if isinstance(tensors, list) else list(tensors)


def _buckets(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of the tensors by (dtype, device), in first-seen order (the same on every rank
    that passes the same dtypes in the same order)."""
    out: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        out.setdefault((t.dtype, t.device), []).append(i)
    return list(out.values())


def all_reduce_coalesced_steps(tensors: list[torch.Tensor], op: Any, group: Any) -> Steps:
    from overlap import comm

    groups = _buckets(tensors)
    # detached: a Parameter's copy back raised half way (a leaf that requires grad), and
    # torch.cat of tensors that require grad records a graph nobody uses
    flats = [torch.cat([tensors[i].detach().reshape(-1) for i in idx]) for idx in groups]
    yield [comm.all_reduce(f, op, group, async_op=True) for f in flats]
    for f, idx in zip(flats, groups, strict=True):
        a = 0
        for i in idx:
            t = tensors[i].detach()
            t.copy_(f[a : a + t.numel()].view(t.shape))
            a += t.numel()
    return tensors


def all_gather_coalesced_steps(
    outputs: list[torch.Tensor], inputs: list[torch.Tensor], group: Any
) -> Steps:
    from overlap import comm

    w = comm.get_world_size(group)
    groups = _buckets(inputs)
    flats = [torch.cat([inputs[i].detach().reshape(-1) for i in idx]) for idx in groups]
    gathered = [f.new_empty(w * f.numel()) for f in flats]
    yield [
        comm.all_gather_into_tensor(g, f, group, async_op=True)
        for g, f in zip(gathered, flats, strict=True)
    ]
    for g, f, idx in zip(gathered, flats, groups, strict=True):
        rows = g.view(w, f.numel())
        a = 0
        for i in idx:
            n = inputs[i].numel()
            outputs[i].detach().view(w, n).copy_(rows[:, a : a + n])
            a += n
    return outputs


def check_gather(
    outputs: Any, inputs: Any, w: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    outs = check_tensors("output_tensors", outputs)
    ins = check_tensors("input_tensors", inputs)
    if len(outs) != len(ins):
        raise ValueError(
            f"all_gather_coalesced needs one output per input: got {len(outs)} outputs for "
            f"{len(ins)} inputs"
        )
    for i, (o, x) in enumerate(zip(outs, ins, strict=True)):
        if o.numel() != w * x.numel() or o.dtype != x.dtype or not o.is_contiguous():
            raise ValueError(
                f"output_tensors[{i}] must be a contiguous {x.dtype} tensor of world_size x "
                f"{x.numel()} = {w * x.numel()} elements (input_tensors[{i}]'s), got "
                f"{o.dtype} with {o.numel()}{'' if o.is_contiguous() else ', not contiguous'}"
            )
    check_distinct(outs, "output_tensors")
    return outs, ins
