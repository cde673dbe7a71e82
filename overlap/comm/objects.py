"""Object collectives: picklable Python objects through tensor collectives, on any backend.

``all_gather_object`` and ``broadcast_object_list`` pickle on the sender, move the bytes
with overlap's own tensor ops (sizes first, then one padded buffer), and unpickle on the
receiver, so they work the same on gloo, NCCL (through CUDA tensors) and MPI.

Like torch's, they use ``pickle``: only exchange objects with ranks you trust, as unpickling
can run code.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

__all__ = ["all_gather_object", "broadcast_object_list"]


def _device(device: Any = None) -> torch.device:
    from overlap import comm

    if device is not None:
        return torch.device(device)
    if comm.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _bytes(obj: Any, dev: torch.device) -> torch.Tensor:
    data = pickle.dumps(obj)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    """Fill ``object_list`` (one slot per rank of the group) with every rank's ``obj``."""
    from overlap import comm
    from overlap.comm.comms_logger import BYPASS

    w = comm.get_world_size(group)
    if not isinstance(object_list, list) or len(object_list) != w:
        raise ValueError(
            f"object_list must be a list with one slot per rank ({w}), got "
            f"{len(object_list) if isinstance(object_list, list) else type(object_list).__name__}"
            f"; pass [None] * get_world_size(group)"
        )
    dev = _device()
    mine = _bytes(obj, dev)
    sizes = torch.zeros(w, dtype=torch.int64, device=dev)
    local = torch.tensor([mine.numel()], dtype=torch.int64, device=dev)
    comm.all_gather_into_tensor(sizes, local, group, log_name=BYPASS)
    counts = [int(n) for n in sizes.tolist()]
    top = max(counts)
    padded = torch.zeros(top, dtype=torch.uint8, device=dev)
    padded[: mine.numel()] = mine
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
    ValueError once the broadcast is done, so no rank is left waiting)."""
    from overlap import comm
    from overlap.comm.comms_logger import BYPASS

    if not isinstance(object_list, list):
        raise TypeError(f"object_list must be a list, got {type(object_list).__name__}")
    dev = _device(device)
    me = comm.get_rank() == src
    payload = _bytes(list(object_list), dev) if me else None
    head = torch.tensor(
        [payload.numel() if payload is not None else 0, len(object_list)],
        dtype=torch.int64,
        device=dev,
    )
    comm.broadcast(head, src, group, log_name=BYPASS)
    n, length = (int(x) for x in head.tolist())
    buf = payload if payload is not None else torch.empty(n, dtype=torch.uint8, device=dev)
    comm.broadcast(buf, src, group, log_name=BYPASS)  # taken even to refuse: no one waits
    if me:
        return
    if length != len(object_list):
        raise ValueError(
            f"broadcast_object_list: rank {src} sent {length} objects, this rank's list has "
            f"{len(object_list)} (left unchanged); pass a list of the same length on every rank"
        )
    object_list[:] = pickle.loads(buf.cpu().numpy().tobytes())
