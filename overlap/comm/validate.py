"""Argument checks shared by the backends. Each error names the problem and the fix.

Checks run before anything is sent, so a bad call fails on the rank that made it and leaves
every tensor untouched. (A bad call made on *all* ranks therefore fails on all of them; a call
made on one rank only is the mismatch that the debug mode of the reliability work catches.)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["check_peer", "check_tensor", "check_tensor_list", "nbytes_of", "writable"]


def check_tensor(t: Any, name: str, device_type: str, backend: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_sparse:
        raise TypeError(f"{name} is a sparse tensor; pass a dense tensor (t.to_dense())")
    if not t.is_contiguous():
        raise ValueError(
            f"{name} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); pass "
            f"{name}.contiguous() (a copy; where the op writes into {name}, copy the result "
            "back if you need it in place)"
        )
    if t.is_conj() or t.is_neg():
        # A lazy view: its memory holds the values conjugated back (or negated), and ops
        # move memory. Before the forty-eighth session MPI sent a conjugate view's memory
        # as if it were its values (the receiver got the unconjugated numbers), and gloo
        # left a negative view unreduced on every rank, silently.
        what, fix = (
            ("a conjugate view (x.conj())", "resolve_conj")
            if t.is_conj()
            else ("a negative view (e.g. z.conj().imag)", "resolve_neg")
        )
        raise ValueError(
            f"{name} is {what}: its memory does not hold its values, and an op moves "
            f"memory; pass {name}.{fix}() (a copy; where the op writes into {name}, copy the "
            "result back if you need it in place)"
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


def writable(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors an op writes into a list of outputs: ``ts`` itself, or a copy of the
    list with each entry that requires grad (a Parameter) detached, the same memory.

    Why: the copies into the outputs (torch's, and overlap's own) raised "a leaf Variable
    that requires grad is being used in an in-place operation" once the data had arrived,
    where the single-tensor collectives take the detached view already. The caller's list
    stays the op's result."""
    if not any(t.requires_grad for t in ts):
        return ts
    return [t.detach() if t.requires_grad else t for t in ts]


def check_peer(rank: int, what: str, group_ranks: Sequence[int], group_name: str) -> None:
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise TypeError(
            f"{what} must be an int (a global rank), got {type(rank).__name__}; pass int({what})"
        )
    if rank not in group_ranks:
        raise ValueError(
            f"{what}={rank} is not a rank of group {group_name} (its global ranks are "
            f"{list(group_ranks)}); pass the global rank of a group member"
        )


def check_p2p_peer(
    peer: int, what: str, group_ranks: Sequence[int], group_name: str, me: int
) -> int:
    """A point-to-point peer: a member of the group, and not this rank. Returns its index."""
    check_peer(peer, what, group_ranks, group_name)
    if peer == me:
        raise ValueError(
            f"{what}={peer} is this rank; a rank cannot send to or receive from itself"
        )
    return list(group_ranks).index(peer)


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


# ---------------------------------------------------------------- shape checks of collectives
def check_like(ts: Sequence[torch.Tensor], ref: torch.Tensor, name: str, ref_name: str) -> None:
    """Every tensor of ``ts`` has ``ref``'s shape and dtype."""
    for i, o in enumerate(ts):
        if o.shape != ref.shape or o.dtype != ref.dtype:
            raise ValueError(
                f"{name}[{i}] is {o.dtype}{list(o.shape)} but {ref_name} is "
                f"{ref.dtype}{list(ref.shape)}; every {name} entry must match {ref_name}"
            )


def _spans(ts: Sequence[tuple[int, Any]]) -> list[tuple[int, int, int]]:
    """(start, end, index) of the bytes of each (index, tensor) that is a tensor with
    bytes, sorted by start; anything else is the backend's to refuse."""
    out = []
    for i, t in ts:
        if isinstance(t, torch.Tensor) and t.numel():
            a = t.data_ptr()
            out.append((a, a + t.numel() * t.element_size(), i))
    return sorted(out)


def _shared(spans: list[tuple[int, int, int]]) -> tuple[int, int] | None:
    """The indices (lower first) of two of :func:`_spans`' tensors that share bytes."""
    for (_, end, i), (start, _, j) in itertools.pairwise(spans):
        if start < end:
            return min(i, j), max(i, j)
    return None


def check_distinct(ts: Sequence[torch.Tensor], name: str) -> None:
    """No two tensors of an output list share bytes. ``[torch.empty(n)] * w`` is one tensor
    w times, and every rank's part landed in it in turn: an all_gather on 2 ranks left
    [[1, 1], [1, 1]] for [[0, 0], [1, 1]], with no error (torch's too)."""
    pair = _shared(_spans(list(enumerate(ts))))
    if pair is not None:
        a, b = pair
        same = "is" if ts[a] is ts[b] else "shares memory with"
        raise ValueError(
            f"{name}[{b}] {same} {name}[{a}]: each rank's part would overwrite another's. "
            f"Give every entry its own tensor ([torch.empty(n) for _ in range(world_size)], "
            f"not [torch.empty(n)] * world_size)"
        )


def _cpu(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_cpu


def check_batch_buffers(roles: Sequence[tuple[Sequence[Any], Sequence[Any]]]) -> None:
    """In one ``batch_isend_irecv`` (``roles``: each op's (tensors written, tensors read)),
    no two receives land in the same bytes and no send reads bytes a receive writes: the
    batch's ops run at once, so either was a race (two sends of one tensor are fine).
    Entries that are not CPU tensors are the backend's to refuse."""
    recvs = _spans([(i, t) for i, (ws, _) in enumerate(roles) for t in ws if _cpu(t)])
    pair = _shared(recvs)
    if pair is not None:
        raise ValueError(
            f"batch_isend_irecv: receives {pair[0]} and {pair[1]} of p2p_op_list land in the "
            "same memory, and the batch's ops run at once; give each receive its own tensor"
        )
    for a, b, i in _spans([(i, t) for i, (_, rs) in enumerate(roles) for t in rs if _cpu(t)]):
        hit = next((j for s, e, j in recvs if a < e and s < b), None)
        if hit is not None:
            raise ValueError(
                f"batch_isend_irecv: send {i} of p2p_op_list reads memory that receive {hit} "
                "of the same batch writes, and the batch's ops run at once; send a copy "
                "(tensor.clone()), or receive into another tensor"
            )


def _no_scalar(op: str, **ts: torch.Tensor) -> None:
    """Gathered and scattered tensors are split along dim 0: a 0-dim tensor has none (gloo
    crashed the process on one: SIGSEGV, torch 2.13)."""
    for name, t in ts.items():
        if t.dim() == 0:
            raise ValueError(
                f"{op}: {name} is a 0-dim tensor, which cannot be split across ranks; pass "
                f"{name}.reshape(1)"
            )


def check_gathered_size(out: torch.Tensor, inp: torch.Tensor, size: int) -> None:
    _no_scalar("all_gather_into_tensor", output_tensor=out, tensor=inp)
    if out.numel() != inp.numel() * size:
        raise ValueError(
            f"all_gather_into_tensor: output has {out.numel()} elements, expected "
            f"world_size ({size}) x input ({inp.numel()}) = {inp.numel() * size}"
        )
    if out.dtype != inp.dtype:
        raise TypeError(f"output dtype {out.dtype} differs from input dtype {inp.dtype}")


def check_reduce_scatter_flat(out: torch.Tensor, inp: torch.Tensor, size: int) -> None:
    _no_scalar("reduce_scatter", output=out, input_list=inp)
    if inp.numel() != out.numel() * size:
        raise ValueError(
            f"reduce_scatter: input has {inp.numel()} elements, which is not "
            f"world_size ({size}) x output ({out.numel()}) = {out.numel() * size}; "
            "size the input as world_size x output"
        )
    if inp.dtype != out.dtype:
        raise TypeError(f"input dtype {inp.dtype} differs from output dtype {out.dtype}")


def check_reduce_scatter_list(out: torch.Tensor, ins: Sequence[torch.Tensor]) -> None:
    for i, x in enumerate(ins):
        if x.numel() != out.numel() or x.dtype != out.dtype:
            raise ValueError(
                f"reduce_scatter: input[{i}] is {x.dtype}[{x.numel()}] but output is "
                f"{out.dtype}[{out.numel()}]; every input chunk must match the output"
            )


def check_splits(t: torch.Tensor, splits: Sequence[int] | None, name: str, size: int) -> list[int]:
    """Split sizes along dim 0 (equal if None); ValueError if they do not fit ``t``."""
    rows = t.shape[0] if t.dim() else 0
    if splits is None:
        if t.dim() == 0 or rows % size:
            raise ValueError(
                f"all_to_all_single: {name} dim 0 ({rows}) does not divide by world_size "
                f"({size}); pass {name}_split_sizes"
            )
        return [rows // size] * size
    try:
        sizes = [int(s) for s in splits]  # a list, a tuple, a tensor or an array of counts
    except (TypeError, ValueError):
        raise TypeError(
            f"all_to_all_single: {name}_split_sizes must be a sequence of ints, got "
            f"{type(splits).__name__}"
        ) from None
    if len(sizes) != size or sum(sizes) != rows or min(sizes) < 0:
        raise ValueError(
            f"all_to_all_single: {name}_split_sizes {sizes} must have {size} entries, none "
            f"negative, summing to {name} dim 0 ({rows})"
        )
    return sizes


def scratch_like(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    """n stand-ins for ``t``: NaN for floating point (so misuse shows), zeros otherwise."""
    fill = float("nan") if t.is_floating_point() or t.is_complex() else 0
    return [torch.full_like(t, fill) for _ in range(n)]


def root_refusal(exc: Exception, op: str, take_part: Any) -> Exception:
    """A bad argument only the root can see (its gather/scatter list): the other ranks have
    issued the collective already, so the root takes part with scratch buffers (``take_part``,
    blocking) before raising; the group stays in step. Returns the error to raise."""
    take_part()
    return type(exc)(
        f"{exc} (this rank took part in the {op} with scratch buffers first, so the other "
        "ranks' call completed and the group stays in step; a scatter's receivers got NaN "
        "or zeros)"
    )


def checked_root_list(
    ts: Any,
    name: str,
    op: str,
    root_word: str,
    root: int,
    size: int,
    like: torch.Tensor,
    as_list: Any,
    take_part: Any,
) -> list[torch.Tensor]:
    """The root's gather/scatter list, checked (``as_list`` is the backend's list check);
    if it is bad, the root takes part with scratch buffers (``take_part()``) and raises."""
    try:
        check_root_list(ts, name, op, root_word, root, size)
        out: list[torch.Tensor] = as_list(ts, name, size)
        check_like(out, like, name, "tensor")
        if op == "gather":  # the list it writes (a scatter's is only read)
            check_distinct(out, name)
        return out
    except (TypeError, ValueError) as exc:
        raise root_refusal(exc, op, take_part) from None


def check_root_list(ts: Any, name: str, op: str, root_word: str, root: int, size: int) -> None:
    if ts is None:
        raise ValueError(
            f"{op}: the {root_word} rank {root} must pass {name}, one tensor per rank ({size})"
        )
