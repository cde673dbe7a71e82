"""Reduction operators: one spelling for users, translated per backend.

Accepted everywhere an ``op`` is taken: a string (``"sum"``, ``"avg"``, ``"product"``,
``"min"``, ``"max"``, ``"band"``, ``"bor"``, ``"bxor"``, any case), :class:`ReduceOp`,
``torch.distributed.ReduceOp.X``, or any enum whose ``name`` is one of those (for example
``deepspeed.comm.ReduceOp.SUM``). Unknown names raise ``ValueError`` listing the valid ones;
DeepSpeed calls ``exit(0)`` there.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

__all__ = ["ReduceOp", "check_reducible", "parse_op"]


class ReduceOp(str, enum.Enum):
    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"
    UNUSED = "unused"  # deepspeed.comm's placeholder member; no op accepts it

    # A member equals its string ("sum" == ReduceOp.SUM), so it must hash like it too; Enum's
    # own __hash__ (hash of the name, in Python) broke that and cost 0.27 us per hash against
    # 0.06 us, paid by every op's (op, dtype) cache lookup now that ReduceOp.SUM is the
    # default op.
    __hash__ = str.__hash__


_ALIASES = {"prod": ReduceOp.PRODUCT, "mean": ReduceOp.AVG, "average": ReduceOp.AVG}
_VALID = ", ".join(repr(o.value) for o in ReduceOp if o.value != "unused")


def parse_op(op: Any) -> ReduceOp:
    """Normalise any accepted spelling of a reduction to :class:`ReduceOp`."""
    if isinstance(op, ReduceOp) and op is not ReduceOp.UNUSED:
        return op
    name: str | None = None
    if isinstance(op, str):
        name = op
    else:
        # torch's ReduceOp.SUM (a RedOpType enum value) and other enums have .name;
        # a torch.distributed.ReduceOp instance wraps one (its str() ends with the name).
        name = getattr(op, "name", None)
        if name is None and type(op).__name__ == "ReduceOp":
            name = str(op).rsplit(".", 1)[-1]
    if isinstance(name, str):
        key = name.strip().lower()
        if key == "premul_sum":
            raise ValueError("op='premul_sum' is not supported; scale the tensor, then use 'sum'")
        if key in _ALIASES:
            return _ALIASES[key]
        if key != "unused":
            try:
                return ReduceOp(key)
            except ValueError:
                pass
    raise ValueError(f"unknown reduction op {op!r}; valid ops are {_VALID}")


_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


def check_reducible(op: ReduceOp, dtype: torch.dtype) -> None:
    """Refuse (TypeError) reductions that make no sense for ``dtype``, before any rank sends."""
    if op is ReduceOp.AVG and not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(
            f"op='avg' needs a floating-point tensor, got {dtype}; "
            "use op='sum' and divide, or convert the tensor to a float dtype"
        )
    if op in _BITWISE and (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(
            f"op={op.value!r} is bitwise and needs an integer or bool tensor, got {dtype}"
        )
    if op in (ReduceOp.MIN, ReduceOp.MAX) and dtype.is_complex:
        raise TypeError(f"op={op.value!r} is undefined for complex tensors ({dtype})")


def divides_first(op: ReduceOp, dtype: torch.dtype) -> bool:
    """Whether an ``avg`` of ``dtype`` divides each rank's values by the group size before
    they are summed, rather than dividing the sum.

    float16 does, as NCCL's own average does (a pre-multiplied sum for floating types) and
    as torch's DDP hooks do: its range ends at 65504, so the sum of two ranks' 40000 was
    inf on gloo and MPI where NCCL gave 40000. Other floating dtypes keep one division of
    the sum (one rounding, and no values pushed towards the subnormals); their range is
    not left by a sum of values that are themselves in range."""
    return op is ReduceOp.AVG and dtype is torch.float16
