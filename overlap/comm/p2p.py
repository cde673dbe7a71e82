"""P2POp: one send or receive for :func:`overlap.comm.batch_isend_irecv`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["P2POp"]


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
