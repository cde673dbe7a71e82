"""ProcessTopology: DeepSpeed's documented examples, and its defects fixed (pure, no ranks)."""

from __future__ import annotations

import numpy as np
import pytest

from overlap.topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
    _prime_factors,
)


def test_deepspeed_docstring_examples() -> None:
    x = ProcessTopology(axes=["x", "y"], dims=[2, 3])
    assert x.get_rank(x=0, y=1) == 1
    assert x.get_dim("y") == 3 and x.get_dim("z") == 0
    coord = x.get_coord(rank=1)
    assert (coord.x, coord.y) == (0, 1)
    assert x.get_axis_list(axis="x", idx=0) == [0, 1, 2]
    assert x.get_axis_list(axis="y", idx=0) == [0, 3]
    assert x.world_size() == 6 and x.get_axis_names() == ["x", "y"]
    t = ProcessTopology(axes=["pipe", "data", "model"], dims=[2, 2, 2])
    assert t.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t.get_axis_comm_lists("absent") == []
    assert t.filter_match(pipe=0, data=1) == [2, 3]
    assert [tuple(t.get_coord(r)) for r in t.filter_match(pipe=0, data=1)] == [(0, 1, 0), (0, 1, 1)]
    ab = ProcessTopology(axes=["a", "b"], dims=[2, 2])
    assert ab.get_rank_repr(rank=3) == "a_01-b_01"
    assert ab.get_rank_repr(rank=3, omit_axes=["a"]) == "b_01"
    assert t.get_rank_repr(5) == "model_01"  # data and pipe omitted by default


def test_row_major_layout_roundtrips() -> None:
    t = ProcessTopology(axes=["pipe", "data", "model"], dims=[3, 2, 4])
    for r in range(t.world_size()):
        assert t.get_rank(**t.get_coord(r)._asdict()) == r
    assert t.get_rank(pipe=1, data=0, model=2) == 1 * 8 + 0 * 4 + 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pipe": 0}, r"missing \['data'\]"),
        ({"pipe": 0, "data": 0, "model": 1}, r"unknown \['model'\]"),
        ({"pipe": 5, "data": 0}, r"coordinate pipe=5 is outside the axis \(0\.\.1\)"),
        ({"pipe": -1, "data": 0}, r"coordinate pipe=-1"),
    ],
)
def test_get_rank_with_a_bad_coordinate_raises_value_error(
    kwargs: dict[str, int], match: str
) -> None:
    t = PipeDataParallelTopology(num_pp=2, num_dp=2)
    with pytest.raises(ValueError, match=match):  # DeepSpeed: NameError
        t.get_rank(**kwargs)


def test_other_bad_input() -> None:
    with pytest.raises(ValueError, match="same length"):
        ProcessTopology(["a"], [1, 2])
    with pytest.raises(ValueError, match="unique"):
        ProcessTopology(["a", "a"], [1, 2])
    with pytest.raises(ValueError, match=">= 1"):
        ProcessTopology(["a"], [0])
    with pytest.raises(TypeError, match=r"dims must be integers, got \[2, 2\.5\]"):
        ProcessTopology(["a", "b"], [2, 2.5])  # before: a 2 x 2 grid
    assert ProcessTopology(["a"], [np.int64(3)]).dims == [3]
    t = ProcessTopology(["a"], [3])
    with pytest.raises(ValueError, match="rank 3 not found"):
        t.get_coord(3)
    with pytest.raises(ValueError, match="unknown axes"):
        t.filter_match(b=1)
    with pytest.raises(ValueError, match="strictly positive"):
        _prime_factors(0)


def test_specialisations() -> None:
    assert PipeDataParallelTopology(2, 3).get_axis_names() == ["pipe", "data"]
    pmd = PipeModelDataParallelTopology(num_pp=2, num_mp=3, num_dp=4)
    assert pmd.get_axis_names() == ["pipe", "data", "model"] and pmd.dims == [2, 4, 3]
    assert _prime_factors(12) == [2, 2, 3]


def test_get_coord_is_constant_time_lookup() -> None:
    t = ProcessTopology(["pipe", "data", "model"], [16, 16, 16])
    assert tuple(t.get_coord(4095)) == (15, 15, 15)
    assert t._coords[4095] is t.get_coord(4095)  # an index, not a scan of the mapping
