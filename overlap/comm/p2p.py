"""P2POp: one send or receive for :func:`overlap.comm.batch_isend_irecv`."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["P2POp"]


# Tags of overlap's own point-to-point traffic (the ring and naive allreduce, and
# monitored_barrier's two): the public send/recv refuse them, so a user's receive can never
# take one of those messages.
RESERVED_TAGS = range(20_000, 30_000)
ALGORITHM_TAGS = range(20_000, 29_900)  # the ring and naive allreduce cycle through these
MONITORED_BARRIER_TAGS = (29_998, 29_999)  # arrive, release
# Debug mode's message payloads on gloo (overlap.comm.p2p_debug); 2**31 - 1 is torch's
# largest tag.
PAYLOAD_TAGS = range(2**30, 2**31)


def dtype_name(dtype: torch.dtype) -> str:
    """``float32``: a dtype as error messages and debug fingerprints name it."""
    return str(dtype).replace("torch.", "")


def describe(t: torch.Tensor) -> str:
    """``float32[2, 3]``: a tensor as error messages name it."""
    return f"{dtype_name(t.dtype)}{list(t.shape)}"


def check_tag(tag: int) -> None:
    try:
        tag = operator.index(tag)
    except TypeError:
        raise TypeError(f"tag must be an int, got {type(tag).__name__}") from None
    if tag < 0:
        raise ValueError(f"tag={tag} is negative; tags are 0 to {PAYLOAD_TAGS.start - 1}")
    if tag in PAYLOAD_TAGS or tag >= PAYLOAD_TAGS.stop:
        raise ValueError(
            f"tag={tag} is reserved: tags from {PAYLOAD_TAGS.start} (2**30) up carry debug "
            f"mode's message payloads; use a tag below {PAYLOAD_TAGS.start}"
        )
    if tag in RESERVED_TAGS:
        raise ValueError(
            f"tag={tag} is reserved: tags {RESERVED_TAGS.start}-{RESERVED_TAGS.stop - 1} carry "
            "overlap's own messages (all_reduce(algorithm=...), monitored_barrier); use a tag "
            "outside that range"
        )


@dataclass
class P2POp:
    """A point-to-point op to batch: ``op`` is ``"isend"``/``"irecv"`` or the function itself.

    ``peer`` is a global rank, as in ``torch.distributed.P2POp``.
    """

    op: Any
    tensor: torch.Tensor
    peer: int
    group: Any = None
    tag: int = 0

    @property
    def kind(self) -> str:
        name = self.op if isinstance(self.op, str) else getattr(self.op, "__name__", "")
        if name not in ("isend", "irecv"):
            raise ValueError(
                f"P2POp.op must be 'isend' or 'irecv' (or those functions), got {self.op!r}"
            )
        return name
