"""Object collectives: picklable Python objects through tensor collectives, on any backend.

``all_gather_object``, ``broadcast_object_list``, ``gather_object`` and
``scatter_object_list`` pickle on the sender, move the bytes with overlap's own tensor ops
(sizes first, then one padded buffer), and unpickle on the receiver, so they work the same
on gloo, NCCL (through CUDA tensors) and MPI.

Every rank takes part in the first exchange even when its own input is bad, with an error
code in place of its byte count, so that bad input on one rank makes every rank raise
instead of leaving the others waiting (and pairing their next collective with this one).

Like torch's, they use ``pickle``: only exchange objects with ranks you trust, as unpickling
can run code.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from overlap.dtypes import float8_dtypes, present
from overlap.errors import CommError

__all__ = [
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "recv_object_list",
    "scatter_object_list",
    "send_object_list",
]


def _device(device: Any = None) -> torch.device:
    from overlap import comm

    if device is not None:
        return torch.device(device)
    if comm.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# A rank that cannot take part still joins the first exchange, with one of these in place
# of its byte count, so that every rank stops there (no rank is left waiting in the second
# exchange, and none pairs its next collective with it); it raises its own error, the
# others a CommError naming it.
_CANNOT_PICKLE = -1
_BAD_LIST = -2
_WHY = {
    _CANNOT_PICKLE: "could not pickle its object",
    _BAD_LIST: "passed an object_list of the wrong kind or length",
}


# Tensors whose own pickling torch cannot load back (torch 2.13: "type object
# 'torch.storage.UntypedStorage' has no attribute 'dtype'" in pickle.loads), for which the
# object collectives failed on every receiver; they travel as their bytes instead.
_UNPICKLABLE = frozenset(present("uint16", "uint32", "uint64") + float8_dtypes())


def _tensor_from_bytes(raw: torch.Tensor, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """Rebuild what :class:`_Pickler` took apart (importable: the receiver unpickles it)."""
    return raw.view(dtype).reshape(shape)


class _Pickler(pickle.Pickler):
    """pickle, with the tensors torch cannot unpickle sent as a uint8 view of their bytes."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.dtype in _UNPICKLABLE:
            raw = obj.detach().contiguous().reshape(-1, 1).view(torch.uint8).clone()
            return _tensor_from_bytes, (raw, obj.dtype, list(obj.shape))
        return NotImplemented


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf).dump(obj)
    return buf.getvalue()


def _bytes(obj: Any, dev: torch.device) -> torch.Tensor:
    data = _dumps(obj)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)


def _pickled(obj: Any, dev: torch.device) -> tuple[torch.Tensor | None, BaseException | None]:
    try:
        return _bytes(obj, dev), None
    except Exception as exc:  # PicklingError, TypeError (a lock), AttributeError (a local)
        return None, TypeError(
            f"cannot pickle {type(obj).__name__} ({type(exc).__name__}: {exc}); exchange "
            "objects that pickle (plain data, or classes importable on every rank)"
        )


def _pickled_each(
    objs: list[Any], dev: torch.device
) -> tuple[list[torch.Tensor], BaseException | None]:
    """Each object's pickled bytes, in order; at the first that does not pickle, the ones
    before it and that error."""
    out: list[torch.Tensor] = []
    for o in objs:
        data, err = _pickled(o, dev)
        if data is None:
            return out, err
        out.append(data)
    return out, None


def _what(x: Any) -> Any:
    """What a bad list argument was, for the error: its length, or its type's name."""
    return len(x) if isinstance(x, list) else type(x).__name__


def _peers_failed(op: str, codes: dict[int, int]) -> CommError:
    detail = "; ".join(f"rank {r} {_WHY.get(c, 'failed')}" for r, c in sorted(codes.items()))
    return CommError(
        f"{op}: {detail}, so nothing was exchanged (every rank raises; the group stays in "
        "step). Fix the call on that rank"
    )


def _sized(
    op: str, obj: Any, bad: BaseException | None, group: Any, dev: torch.device
) -> tuple[torch.Tensor, list[int]]:
    """The size exchange every gathering object collective starts with: each rank's pickled
    byte count, all-gathered, with an error code in its place where this rank's list is
    ``bad`` (that error) or ``obj`` does not pickle. Raises this rank's own error, or a
    CommError naming the ranks that failed, on every rank alike. Returns this rank's bytes
    padded to the largest count, and every rank's count in group-rank order."""
    from overlap import comm
    from overlap.comm.comms_logger import BYPASS

    mine: torch.Tensor | None = None
    err: BaseException | None = bad
    if bad is not None:
        code = _BAD_LIST
    else:
        mine, err = _pickled(obj, dev)
        code = _CANNOT_PICKLE if mine is None else mine.numel()
    sizes = torch.zeros(comm.get_world_size(group), dtype=torch.int64, device=dev)
    local = torch.tensor([code], dtype=torch.int64, device=dev)
    comm.all_gather_into_tensor(sizes, local, group, log_name=BYPASS)
    counts = [int(n) for n in sizes.tolist()]
    if err is not None:
        raise err
    failed = {comm.get_global_rank(group, i): c for i, c in enumerate(counts) if c < 0}
    if failed:
        raise _peers_failed(op, failed)
    assert mine is not None
    padded = torch.zeros(max(counts), dtype=torch.uint8, device=dev)
    padded[: mine.numel()] = mine
    return padded, counts


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    """Fill ``object_list`` (one slot per rank of the group) with every rank's ``obj``.

    A rank whose list is wrong, or whose ``obj`` does not pickle, raises (ValueError,
    TypeError) after the size exchange, and every other rank raises CommError naming it:
    no rank is left waiting."""
    from overlap import comm
    from overlap.comm.comms_logger import BYPASS

    w = comm.get_world_size(group)
    dev = _device()
    bad = None
    if not isinstance(object_list, list) or len(object_list) != w:
        bad = ValueError(
            f"object_list must be a list with one slot per rank ({w}), got "
            f"{_what(object_list)}; pass [None] * get_world_size(group)"
        )
    padded, counts = _sized("all_gather_object", obj, bad, group, dev)
    top = padded.numel()
    every = torch.empty(w * top, dtype=torch.uint8, device=dev)
    comm.all_gather_into_tensor(every, padded, group, log_name=BYPASS)
    host = every.cpu().numpy()
    for i, n in enumerate(counts):
        object_list[i] = pickle.loads(host[i * top : i * top + n].tobytes())


def broadcast_object_list(
    object_list: list[Any], src: int, group: Any = None, device: Any = None
) -> None:
    """Replace each element of ``object_list`` with rank ``src``'s (a global rank); every rank
    passes a list of the same length (a receiver whose list has another length raises
    ValueError once the broadcast is done, so no rank is left waiting). A source whose
    list is not a list or does not pickle raises after the first broadcast, and the
    receivers raise CommError naming it."""
    from overlap import comm
    from overlap.comm.comms_logger import BYPASS

    dev = _device(device)
    me = comm.get_rank() == src
    is_list = isinstance(object_list, list)
    payload: torch.Tensor | None = None
    err: BaseException | None = None
    if me:
        if is_list:
            payload, err = _pickled(list(object_list), dev)
            code = _CANNOT_PICKLE if payload is None else payload.numel()
        else:
            err = TypeError(f"object_list must be a list, got {type(object_list).__name__}")
            code = _BAD_LIST
        head = torch.tensor([code, len(object_list) if is_list else 0], dtype=torch.int64)
    else:
        head = torch.zeros(2, dtype=torch.int64)
    head = head.to(dev)
    comm.broadcast(head, src, group, log_name=BYPASS)
    n, length = (int(x) for x in head.tolist())
    if err is not None:
        raise err
    if n < 0:
        raise _peers_failed("broadcast_object_list", {src: n})
    buf = payload if payload is not None else torch.empty(n, dtype=torch.uint8, device=dev)
    comm.broadcast(buf, src, group, log_name=BYPASS)  # taken even to refuse: no one waits
    if me:
        return
    if not is_list:
        raise TypeError(
            f"object_list must be a list, got {type(object_list).__name__} (the broadcast "
            "was taken and dropped)"
        )
    if length != len(object_list):
        raise ValueError(
            f"broadcast_object_list: rank {src} sent {length} objects, this rank's list has "
            f"{len(object_list)} (left unchanged); pass a list of the same length on every rank"
        )
    object_list[:] = pickle.loads(buf.cpu().numpy().tobytes())


def _check_root(op: str, root: Any, group: Any) -> None:
    """ValueError, before anything is exchanged, unless ``root`` (a global rank) is a member
    of ``group``: every rank makes the same check, so every rank raises."""
    from overlap import comm

    members = comm.get_all_ranks_from_group(group)
    if isinstance(root, bool) or not isinstance(root, int) or root not in members:
        raise ValueError(
            f"{op}: {root!r} is not a rank of the group (its global ranks are {members}); "
            "pass the global rank of a member"
        )


def gather_object(
    obj: Any, object_gather_list: list[Any] | None = None, dst: int = 0, group: Any = None
) -> None:
    """Fill ``object_gather_list`` on rank ``dst`` (a global rank; one slot per rank of the
    group, in group-rank order) with every rank's ``obj``; other ranks' lists are ignored
    (pass None), as torch's.

    The byte counts are all-gathered first, so a bad list on ``dst`` or an ``obj`` that does
    not pickle on any rank makes that rank raise (ValueError, TypeError) and every other
    rank raise CommError naming it: no rank is left waiting."""
    from overlap import comm
    from overlap.comm.comms_logger import BYPASS

    _check_root("gather_object", dst, group)
    w = comm.get_world_size(group)
    dev = _device()
    me = comm.get_rank() == dst
    bad = None
    if me and (not isinstance(object_gather_list, list) or len(object_gather_list) != w):
        bad = ValueError(
            f"object_gather_list on the destination must be a list with one slot per rank "
            f"({w}), got {_what(object_gather_list)}; pass [None] * get_world_size(group)"
        )
    padded, counts = _sized("gather_object", obj, bad, group, dev)
    top = padded.numel()
    parts = [torch.empty(top, dtype=torch.uint8, device=dev) for _ in range(w)] if me else None
    comm.gather(padded, parts, dst, group, log_name=BYPASS)
    if parts is None:
        return
    assert object_gather_list is not None
    for i, (part, n) in enumerate(zip(parts, counts, strict=True)):
        object_gather_list[i] = pickle.loads(part[:n].cpu().numpy().tobytes())


def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int = 0,
    group: Any = None,
) -> None:
    """Put ``scatter_object_input_list[i]`` of rank ``src`` (a global rank; one object per
    rank of the group, in group-rank order) into ``scatter_object_output_list[0]`` on group
    rank i, as torch's; the input list is ignored on other ranks.

    The source pickles every object before anything moves and broadcasts the largest size
    (or an error code), so a bad input list or an object that does not pickle makes the
    source raise (ValueError, TypeError) and the receivers CommError naming it. A receiver
    whose output list is not a non-empty list raises ValueError once the scatter is done,
    its list unchanged: no rank is left waiting."""
    from overlap import comm
    from overlap.comm.comms_logger import BYPASS

    _check_root("scatter_object_list", src, group)
    w = comm.get_world_size(group)
    dev = _device()
    me = comm.get_rank() == src
    chunks: list[torch.Tensor] = []
    err: BaseException | None = None
    head = torch.zeros(1, dtype=torch.int64)
    if me:
        objs = scatter_object_input_list
        if not isinstance(objs, list) or len(objs) != w:
            err = ValueError(
                f"scatter_object_input_list on the source must be a list with one object per "
                f"rank ({w}), got {_what(objs)}"
            )
            head[0] = _BAD_LIST
        else:
            chunks, err = _pickled_each(objs, dev)
            head[0] = _CANNOT_PICKLE if err is not None else max(c.numel() for c in chunks)
    head = head.to(dev)
    comm.broadcast(head, src, group, log_name=BYPASS)
    top = int(head.item())
    if err is not None:
        raise err
    if top < 0:
        raise _peers_failed("scatter_object_list", {src: top})
    # Each rank's part: its byte count (8 bytes, little-endian int64), then the bytes.
    parts = None
    if me:
        parts = []
        for c in chunks:
            part = torch.zeros(8 + top, dtype=torch.uint8, device=dev)
            part[:8] = torch.tensor([c.numel()], dtype=torch.int64).view(torch.uint8).to(dev)
            part[8 : 8 + c.numel()] = c
            parts.append(part)
    out = torch.empty(8 + top, dtype=torch.uint8, device=dev)
    comm.scatter(out, parts, src, group, log_name=BYPASS)
    if not isinstance(scatter_object_output_list, list) or not scatter_object_output_list:
        raise ValueError(
            "scatter_object_output_list must be a non-empty list (its first element receives "
            f"this rank's object), got {scatter_object_output_list!r}; the scatter was taken "
            "and dropped. Pass [None]"
        )
    host = out.cpu()
    n = int(host[:8].view(torch.int64).item())
    scatter_object_output_list[0] = pickle.loads(host[8 : 8 + n].numpy().tobytes())


def send_object_list(
    object_list: list[Any], dst: int, group: Any = None, device: Any = None
) -> None:
    """Send the picklable objects of ``object_list`` to rank ``dst`` (a global rank), for its
    :func:`recv_object_list` (torch's ``send_object_list``).

    Two messages: a header (the object count and the payload's byte count), then the
    payload (each object's byte count, then the bytes). A list that is not a list, or an
    object that does not pickle, sends an error code in the header and raises here
    (TypeError); the receiver raises CommError naming this rank: it is not left waiting."""
    from overlap import comm
    from overlap.comm.comms_logger import BYPASS

    dev = _device(device)
    err: BaseException | None = None
    parts: list[torch.Tensor] = []
    if not isinstance(object_list, list):
        err = TypeError(f"object_list must be a list, got {type(object_list).__name__}")
        head = [_BAD_LIST, 0]
    else:
        parts, err = _pickled_each(object_list, dev)
        if err is not None:
            head = [_CANNOT_PICKLE, 0]
        else:
            sizes = torch.tensor([p.numel() for p in parts], dtype=torch.int64, device=dev)
            parts.insert(0, sizes.view(torch.uint8))
            head = [len(object_list), sum(p.numel() for p in parts)]
    comm.send(torch.tensor(head, dtype=torch.int64, device=dev), dst, group, log_name=BYPASS)
    if err is not None:
        raise err
    if head[1]:
        comm.send(torch.cat(parts), dst, group, log_name=BYPASS)


def recv_object_list(
    object_list: list[Any], src: int | None = None, group: Any = None, device: Any = None
) -> int:
    """Receive a :func:`send_object_list` from rank ``src`` (a global rank; None: any rank)
    into ``object_list``, which must have as many slots as the sender sent objects;
    returns the sender's global rank (torch's ``recv_object_list``).

    The whole message is taken before the list is checked, so a list of another length
    raises ValueError with the list unchanged and nothing left in flight between the two
    ranks. A sender that could not pickle its objects makes this raise CommError."""
    from overlap import comm
    from overlap.comm.comms_logger import BYPASS

    dev = _device(device)
    head = torch.zeros(2, dtype=torch.int64, device=dev)
    sender = comm.recv(head, src, group, log_name=BYPASS)
    n, total = (int(x) for x in head.tolist())
    if n < 0:
        raise CommError(
            f"recv_object_list: rank {sender} {_WHY.get(n, 'failed')} in its send_object_list "
            "(it raised there), so nothing was sent; fix the call on that rank"
        )
    payload = torch.empty(total, dtype=torch.uint8, device=dev)
    if total:
        comm.recv(payload, sender, group, log_name=BYPASS)  # from the same rank, in order
    if not isinstance(object_list, list) or len(object_list) != n:
        raise ValueError(
            f"recv_object_list: rank {sender} sent {n} objects, and object_list must be a list "
            f"with a slot for each, got {_what(object_list)} (the message was taken and "
            "dropped, the list left unchanged); pass [None] * n"
        )
    host = payload.cpu()
    counts = host[: 8 * n].view(torch.int64).tolist()
    at = 8 * n
    for i, c in enumerate(counts):
        object_list[i] = pickle.loads(host[at : at + c].numpy().tobytes())
        at += c
    return int(sender)
