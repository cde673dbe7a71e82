"""Max and min of floating-point tensors that every rank agrees on, NaN included.

A backend's max and min compare two numbers with ``a > b ? a : b`` (MPICH's ``MPIR_MAXF``) or
``std::max`` (gloo). Every comparison with a NaN is false, so the answer depends on which
operand holds the NaN, and a collective applies the operator in an order no caller controls:

* MPICH, two ranks, a NaN on rank 0: rank 0 got 1.0 and rank 1 got NaN (measured here with
  ``all_reduce(op="max")``), so the ranks went on with different tensors, silently;
* gloo gave every rank the same answer, but NaN only when the NaN was on rank 0: a NaN on
  any other rank was dropped (2 and 3 ranks, max and min), where ``torch.maximum`` and
  ``torch.amax`` propagate it. MLX's issue 4072 shows the same operator returning a wrong
  finite minimum on four ranks.

So a max or min over a floating-point dtype reduces *ordered keys* instead: the float's
bits as a signed integer of its width, with the 31 (63) bits below the sign flipped for a
negative float. Integer order on the keys is float order on the values (-inf < ... < -0.0
< +0.0 < ... < +inf), and an integer max or min is exact, associative and commutative: every
rank gets the same bits whatever the backend's order. A NaN (any sign, any payload) becomes
the largest key for max and the smallest for min, so it wins, as in ``torch.maximum``; it
comes back as a NaN. float16, bfloat16 and the float8 types are widened to float32 first
(exactly) and narrowed back (exactly: the result is one of the inputs).

The cost is a few elementwise passes before and after the collective on a max or min of
floats, which are small tensors in practice (a norm, an overflow flag, a timing); sums,
the gradient path, are untouched. CUDA tensors on NCCL keep NCCL's own max and min: this
path has not been run on a GPU.
"""

from __future__ import annotations

import torch

from overlap.comm.reduce_op import ReduceOp

__all__ = ["from_keys", "key_dtype", "keyed", "to_keys"]

_KEY = {torch.float32: torch.int32, torch.float64: torch.int64}


def keyed(op: ReduceOp, dtype: torch.dtype) -> bool:
    """True when ``op`` on ``dtype`` reduces ordered keys: max or min of a real float."""
    return (op is ReduceOp.MAX or op is ReduceOp.MIN) and dtype.is_floating_point


def key_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype that the keys of a ``dtype`` tensor have."""
    return torch.int64 if dtype is torch.float64 else torch.int32


def to_keys(t: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """A new integer tensor of ``t``'s ordered keys (``t`` is left alone); NaN is the
    extreme key that ``op`` (max or min) picks."""
    wide = t if t.dtype in _KEY else t.to(torch.float32)
    kd = _KEY[wide.dtype]
    bits = wide.view(kd)
    flip = bits >> (bits.element_size() * 8 - 1)  # all ones for a negative float, else 0
    flip &= torch.iinfo(kd).max
    keys = bits ^ flip
    info = torch.iinfo(kd)
    keys.masked_fill_(torch.isnan(wide), info.max if op is ReduceOp.MAX else info.min)
    return keys


def from_keys(keys: torch.Tensor, out: torch.Tensor) -> None:
    """Write the floats of ordered ``keys`` (:func:`to_keys`'s, reduced) into ``out``; the
    keys are overwritten. The extreme keys come back as NaN."""
    flip = keys >> (keys.element_size() * 8 - 1)
    flip &= torch.iinfo(keys.dtype).max
    keys ^= flip
    floats = keys.view(torch.float64 if keys.dtype is torch.int64 else torch.float32)
    out.copy_(floats.view(out.shape))
