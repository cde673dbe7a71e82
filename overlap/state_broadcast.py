"""One rank's parameters or optimizer state to every rank: Horovod's two start-up calls.

Horovod users start a job with ``hvd.broadcast_parameters(model.state_dict(), root_rank=0)``
and ``hvd.broadcast_optimizer_state(optimizer, root_rank=0)``: after a checkpoint loaded on
one rank only, or an optimizer whose state must start equal. :func:`broadcast_parameters` and
:func:`broadcast_optimizer_state` do the same on any overlap backend (a BucketScheduler or
DiLoCo built from a module already starts every rank from rank 0's weights; the optimizer
state is not theirs to send).

Both check before they send: the root's layout (names, shapes, dtypes; for an optimizer,
its parameter groups) goes first as one small object, every rank compares it with its own,
and any difference raises ValueError on *every* rank, naming the ranks and what differs,
with nothing overwritten anywhere. Horovod's pair broadcasts tensors of other shapes into
each other and fails inside the backend, or not at all. Then each tensor goes by one
broadcast, in place (no pickling of the tensors: a model's worth of bytes would otherwise be
pickled, copied and held twice on every rank).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from overlap import comm
from overlap.comm.objects import _device
from overlap.initial_sync import broadcast_state

__all__ = ["broadcast_optimizer_state", "broadcast_parameters"]

log = logging.getLogger(__name__)


class _Slot:
    """Where the root's optimizer state held tensor number ``i`` (its shape and dtype), in
    the skeleton that travels as an object."""

    __slots__ = ("dtype", "i", "shape")

    def __init__(self, i: int, t: torch.Tensor) -> None:
        self.i, self.shape, self.dtype = i, tuple(t.shape), t.dtype


def _named(params: Any) -> list[tuple[str, Any]]:
    """(name, value) pairs of a state_dict, of ``named_parameters()`` or of bare tensors
    (named by position)."""
    if isinstance(params, torch.nn.Module):
        raise TypeError(
            "broadcast_parameters takes the tensors, not the module: pass "
            "model.state_dict() (parameters and buffers) or model.parameters()"
        )
    if isinstance(params, torch.Tensor):
        params = [params]
    if isinstance(params, Mapping):
        return [(str(k), v) for k, v in params.items()]
    out: list[tuple[str, Any]] = []
    for i, p in enumerate(params if isinstance(params, Iterable) else [params]):
        if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str):
            out.append(p)
        else:
            out.append((f"[{i}]", p))
    return out


def _agree(what: str, error: str | None, group: Any) -> None:
    """Every rank learns every rank's ``error``; all raise ValueError if any has one."""
    errors: list[Any] = [None] * comm.get_world_size(group)
    comm.all_gather_object(errors, error, group=group)
    bad = [(comm.get_global_rank(group, i), e) for i, e in enumerate(errors) if e]
    if bad:
        said = "; ".join(f"rank {r}: {e}" for r, e in bad[:4])
        raise ValueError(f"{what}: {said}. Nothing was sent or overwritten on any rank")


def _send(tensors: list[torch.Tensor], src: int, group: Any) -> None:
    """Overwrite each tensor with global rank ``src``'s, one broadcast each."""
    broadcast_state(tensors, group, _device(), root=comm.get_group_rank(group, src))


def _root_layout(src: int, group: Any, layout: Any) -> Any:
    """``src``'s ``layout``, on every rank of ``group``."""
    box = [layout if comm.get_rank() == src else None]
    comm.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _check_src(what: str, src: Any, root_rank: Any, group: Any) -> Any:
    """The root, checked: ``src``, or Horovod's ``root_rank`` spelling of it (0 when
    neither)."""
    if root_rank is not None:
        if src is not None and src != root_rank:
            raise ValueError(
                f"{what}: src={src!r} and root_rank={root_rank!r} name two roots; root_rank "
                "is Horovod's name for src: pass one of them"
            )
        src = root_rank
    elif src is None:
        src = 0
    ranks = comm.get_all_ranks_from_group(group)
    if isinstance(src, bool) or not isinstance(src, int) or src not in ranks:
        raise ValueError(
            f"{what}: src={src!r} is not a global rank of the group (ranks {ranks}); pass "
            "the global rank whose values every rank should take"
        )
    return src


def broadcast_parameters(
    params: Any, src: int | None = None, group: Any = None, *, root_rank: int | None = None
) -> None:
    """Overwrite every tensor of ``params`` with global rank ``src``'s (default 0), in place,
    on every rank of ``group``. Horovod's ``broadcast_parameters``; a collective.
    ``root_rank=`` is Horovod's name for ``src`` and is taken too, so a ported
    ``broadcast_parameters(model.state_dict(), root_rank=0)`` runs as it is.

    ``params``: ``model.state_dict()`` (parameters and buffers, by name),
    ``model.named_parameters()``, or tensors (``model.parameters()``). Every rank passes the
    same names in the same order, with the same shapes and dtypes; otherwise every rank
    raises ValueError naming what differs, and nothing is overwritten. A value that is not a
    tensor (a module's ``_extra_state``) is refused the same way: it cannot be overwritten
    in place."""
    what = "broadcast_parameters"
    src = _check_src(what, src, root_rank, group)
    named = _named(params)
    error = None
    others = [k for k, v in named if not isinstance(v, torch.Tensor)]
    if others:
        error = (
            f"{others[:3]} are not tensors; pass only tensors (for a state_dict: "
            "{k: v for k, v in sd.items() if torch.is_tensor(v)})"
        )
    mine = [(k, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (k,) for k, v in named]
    root = _root_layout(src, group, mine)
    if error is None and root != mine:
        error = _difference(root, mine, src)
    _agree(what, error, group)
    _send([v for _, v in named], src, group)


def _difference(root: list[Any], mine: list[Any], src: int) -> str:
    if len(root) != len(mine):
        return f"{len(mine)} tensors here, {len(root)} on rank {src}"
    for a, b in zip(root, mine, strict=True):
        if a != b:
            return f"{b} here, {a} on rank {src} (name, shape, dtype)"
    return "the layouts differ"  # not reached: root != mine


def _skeleton(state: dict[str, Any], tensors: list[torch.Tensor]) -> dict[str, Any]:
    """``state`` (an optimizer's state_dict) with each tensor of its per-parameter state
    replaced by a :class:`_Slot`, the tensors appended to ``tensors``."""
    out: dict[str, Any] = {}
    for pid, entry in state["state"].items():
        slots = {}
        for k, v in entry.items():
            if isinstance(v, torch.Tensor):
                slots[k] = _Slot(len(tensors), v)
                tensors.append(v)
            else:
                slots[k] = v
        out[pid] = slots
    return {"state": out, "param_groups": state["param_groups"]}


def _kind(optimizer: torch.optim.Optimizer) -> str:
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def _shapes(optimizer: torch.optim.Optimizer) -> list[tuple[int, ...]]:
    return [tuple(p.shape) for g in optimizer.param_groups for p in g["params"]]


def _group_sizes(state: dict[str, Any]) -> list[int]:
    return [len(g["params"]) for g in state["param_groups"]]


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer,
    src: int | None = None,
    group: Any = None,
    *,
    root_rank: int | None = None,
) -> None:
    """Give every rank of ``group`` global rank ``src``'s (default 0) optimizer state: its
    per-parameter state (Adam's moments and step counts...) and its parameter groups'
    settings (lr, betas...). Horovod's ``broadcast_optimizer_state``; a collective.
    ``root_rank=`` is Horovod's name for ``src`` and is taken too.

    Every rank's optimizer must be of the same class and have the same parameter groups,
    with as many parameters each (what ``load_state_dict`` checks) of the same shapes (what
    it does not); otherwise every rank raises ValueError and no rank's state changes. The
    root's tensors go by one broadcast each; the other ranks load the result with
    ``optimizer.load_state_dict``, which puts each tensor on its parameter's device and
    dtype. A state still empty on the root (no step taken) empties it everywhere.

    A :class:`~overlap.OneBitAdam` is refused: its 1-bit error feedback is each rank's own
    (save and load it per rank)."""
    from overlap.optim.onebit_adam import OneBitAdam

    what = "broadcast_optimizer_state"
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{what} takes a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, OneBitAdam):
        raise TypeError(
            f"{what}: a OneBitAdam's state holds each rank's own 1-bit error feedback, which "
            "another rank must not take; save and load its state_dict() per rank"
        )
    src = _check_src(what, src, root_rank, group)
    is_root = comm.get_rank() == src
    state = optimizer.state_dict()
    tensors: list[torch.Tensor] = []
    kind, shapes = _kind(optimizer), _shapes(optimizer)
    skeleton = {**_skeleton(state, tensors), "kind": kind, "shapes": shapes} if is_root else None
    root = _root_layout(src, group, skeleton)
    error = None
    if root["kind"] != kind:
        # another class's groups and state: SGD's groups loaded into an Adam left it with
        # no betas or eps and SGD's lr, silently (forty-fifth session)
        error = f"a {kind} here, a {root['kind']} on rank {src}"
    elif _group_sizes(root) != _group_sizes(state):
        error = (
            f"parameter groups of {_group_sizes(state)} parameters here, "
            f"{_group_sizes(root)} on rank {src}"
        )
    elif root["shapes"] != shapes:
        # load_state_dict checks the group sizes only: moments of other shapes were loaded
        at = next(i for i, (a, b) in enumerate(zip(root["shapes"], shapes, strict=True)) if a != b)
        error = f"parameter {at} has shape {shapes[at]} here, {root['shapes'][at]} on rank {src}"
    _agree(what, error, group)
    if not is_root:
        # the root's tensors land in fresh ones of its shapes and dtypes
        slots = [
            s for entry in root["state"].values() for s in entry.values() if isinstance(s, _Slot)
        ]
        slots.sort(key=lambda s: s.i)
        device = _device()
        tensors = [torch.empty(s.shape, dtype=s.dtype, device=device) for s in slots]
    _send(tensors, src, group)
    if is_root:
        return
    loaded = {
        "state": {
            pid: {k: tensors[v.i] if isinstance(v, _Slot) else v for k, v in entry.items()}
            for pid, entry in root["state"].items()
        },
        "param_groups": root["param_groups"],
    }
    optimizer.load_state_dict(loaded)
    log.debug("optimizer state of %d tensors taken from rank %d", len(tensors), src)
