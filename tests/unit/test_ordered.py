"""Ordered keys (overlap.comm.ordered): an integer max/min of the keys is torch's NaN-propagating
max/min of the floats, for every pair of special values and every float width."""

from __future__ import annotations

import itertools

import pytest
import torch

from overlap.comm.ordered import from_keys, key_dtype, keyed, to_keys
from overlap.comm.reduce_op import ReduceOp

NAN, INF = float("nan"), float("inf")
VALUES = [NAN, -NAN, 1.0, -1.0, 0.0, -0.0, INF, -INF, 1e-40, -1e-40, 3.5, -2.25, 65504.0]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", [ReduceOp.MAX, ReduceOp.MIN])
def test_keys_order_as_floats_and_nan_wins(dtype: torch.dtype, op: ReduceOp) -> None:
    pairs = list(itertools.product(VALUES, VALUES))
    x = torch.tensor([a for a, _ in pairs], dtype=dtype)
    y = torch.tensor([b for _, b in pairs], dtype=dtype)
    x0, y0 = x.clone(), y.clone()
    kx, ky = to_keys(x, op), to_keys(y, op)
    assert kx.dtype == key_dtype(dtype)
    fold = torch.maximum if op is ReduceOp.MAX else torch.minimum
    k = fold(kx, ky)
    out = torch.empty_like(x)
    from_keys(k, out)
    want = fold(x, y)
    nan = want.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan], want[~nan])
    zero = (want == 0) & ((x != y) | (x.signbit() != y.signbit()))
    # signed zeros in total order: -0.0 < +0.0, whichever operand holds which
    assert torch.equal(
        out[zero].signbit(),
        (x.signbit() & y.signbit())[zero]
        if op is ReduceOp.MAX
        else (x.signbit() | y.signbit())[zero],
    )
    assert torch.equal(x.isnan(), x0.isnan()) and torch.equal(x[~x.isnan()], x0[~x0.isnan()])
    assert torch.equal(y.view(-1)[~y.isnan()], y0[~y0.isnan()])  # the inputs are left alone


def test_only_max_and_min_of_real_floats_are_keyed() -> None:
    assert keyed(ReduceOp.MAX, torch.float32) and keyed(ReduceOp.MIN, torch.bfloat16)
    assert not keyed(ReduceOp.SUM, torch.float32)
    assert not keyed(ReduceOp.AVG, torch.float64)
    assert not keyed(ReduceOp.MAX, torch.int64)
    assert not keyed(ReduceOp.MAX, torch.bool)
    assert not keyed(ReduceOp.MAX, torch.complex64)


def test_keys_keep_the_shape_and_come_back_into_it() -> None:
    t = torch.arange(-3.0, 3.0).view(2, 3)
    k = to_keys(t, ReduceOp.MAX)
    assert k.shape == t.shape
    out = torch.empty(2, 3, dtype=torch.float16)
    from_keys(k, out)
    assert torch.equal(out, t.half())
