"""Torch dtypes and reductions mapped onto MPI, refusing what MPI cannot do before it aborts.

MPI implementations do not raise on an invalid (datatype, op) pair: MPICH 5.0.2 *aborts the
process* (measured: an internal assertion for ``MPI_BFLOAT16_T`` with ``MPI_SUM``). So every
reduction is checked here first and refused with a TypeError that names a fix.

* Data movement (broadcast, gathers, all-to-all, p2p) sends raw bytes (``MPI.BYTE``): every
  dtype works.
* Reductions use the matching MPI type. float16 uses ``MPI_FLOAT16_T`` where the library has
  it. bfloat16 has no usable MPI reduction, so it is reduced in a float32 copy and cast back
  (documented: a bf16 sum may then differ in the last bit from a bf16 accumulation).
* bool reduces with logical ops, as gloo's does (it adds or multiplies bools into a bool):
  ``sum``/``max``/``bor`` -> LOR, ``product``/``min``/``band`` -> LAND, ``bxor`` -> LXOR;
  ``avg`` on bool raises TypeError (it needs a float, on every backend).
"""

from __future__ import annotations

from typing import Any

import torch

from overlap.comm.reduce_op import ReduceOp, check_reducible

__all__ = ["INT_MAX", "mpi_op", "reduce_dtype"]

INT_MAX = 2**31 - 1

_BOOL_OPS = {
    ReduceOp.SUM: "LOR",
    ReduceOp.PRODUCT: "LAND",
    ReduceOp.MAX: "LOR",
    ReduceOp.BOR: "LOR",
    ReduceOp.MIN: "LAND",
    ReduceOp.BAND: "LAND",
    ReduceOp.BXOR: "LXOR",
}
_OPS = {
    ReduceOp.SUM: "SUM",
    ReduceOp.AVG: "SUM",
    ReduceOp.PRODUCT: "PROD",
    ReduceOp.MIN: "MIN",
    ReduceOp.MAX: "MAX",
    ReduceOp.BAND: "BAND",
    ReduceOp.BOR: "BOR",
    ReduceOp.BXOR: "BXOR",
}
_TYPES = {
    torch.float32: "FLOAT",
    torch.float64: "DOUBLE",
    torch.float16: "FLOAT16_T",
    torch.int8: "INT8_T",
    torch.uint8: "UINT8_T",
    torch.int16: "INT16_T",
    torch.int32: "INT32_T",
    torch.int64: "INT64_T",
    torch.bool: "C_BOOL",
    torch.complex64: "C_FLOAT_COMPLEX",
    torch.complex128: "C_DOUBLE_COMPLEX",
}


def reduce_dtype(dtype: torch.dtype, MPI: Any) -> tuple[Any, torch.dtype | None]:
    """(MPI datatype, staging dtype or None) for reducing ``dtype``; TypeError if impossible."""
    name = _TYPES.get(dtype)
    if name is not None and getattr(MPI, name, None) is not None:
        return getattr(MPI, name), None
    if dtype in (torch.bfloat16, torch.float16):
        return MPI.FLOAT, torch.float32  # reduce in a float32 copy
    raise TypeError(
        f"MPI cannot reduce {dtype} tensors; convert to a supported dtype "
        f"({', '.join(str(d).replace('torch.', '') for d in _TYPES)}) first"
    )


def mpi_op(op: ReduceOp, dtype: torch.dtype, MPI: Any) -> Any:
    """The MPI.Op for ``op`` on ``dtype``, or TypeError naming why and what to use instead."""
    check_reducible(op, dtype)
    if dtype is torch.bool:
        name = _BOOL_OPS.get(op)
        if name is None:
            raise TypeError(
                f"MPI cannot reduce bool tensors with op={op.value!r}; use 'max' (logical or), "
                "'min' (logical and), or convert the tensor to an integer dtype"
            )
        return getattr(MPI, name)
    return getattr(MPI, _OPS[op])
