from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from overlap.comm.reduce_op import ReduceOp, check_reducible, parse_op


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("sum", ReduceOp.SUM),
        ("SUM", ReduceOp.SUM),
        ("avg", ReduceOp.AVG),
        ("prod", ReduceOp.PRODUCT),
        ("product", ReduceOp.PRODUCT),
        ("min", ReduceOp.MIN),
        ("max", ReduceOp.MAX),
        (ReduceOp.BXOR, ReduceOp.BXOR),
        (dist.ReduceOp.SUM, ReduceOp.SUM),
        (dist.ReduceOp.MAX, ReduceOp.MAX),
        (dist.ReduceOp.PRODUCT, ReduceOp.PRODUCT),
        (dist.ReduceOp.AVG, ReduceOp.AVG),
    ],
)
def test_parse_op_accepts_every_spelling(given: object, expected: ReduceOp) -> None:
    assert parse_op(given) is expected


def test_unknown_op_lists_valid_ops() -> None:
    with pytest.raises(ValueError, match=r"unknown reduction op 'median'.*'sum'.*'avg'.*'max'"):
        parse_op("median")
    with pytest.raises(ValueError, match="unknown reduction op 3"):
        parse_op(3)


def test_premul_sum_is_refused_with_a_fix() -> None:
    with pytest.raises(ValueError, match="scale the tensor"):
        parse_op("premul_sum")


def test_deepspeed_style_enum_by_name() -> None:
    import enum

    class DsReduceOp(enum.Enum):  # the shape of deepspeed.comm.ReduceOp
        SUM = 0
        AVG = 7

    assert parse_op(DsReduceOp.AVG) is ReduceOp.AVG


def test_reducible_dtypes() -> None:
    check_reducible(ReduceOp.AVG, torch.float32)
    check_reducible(ReduceOp.BAND, torch.int32)
    with pytest.raises(TypeError, match=r"avg.*floating-point.*int64"):
        check_reducible(ReduceOp.AVG, torch.int64)
    with pytest.raises(TypeError, match="bitwise"):
        check_reducible(ReduceOp.BOR, torch.float32)
    with pytest.raises(TypeError, match="complex"):
        check_reducible(ReduceOp.MAX, torch.complex64)
