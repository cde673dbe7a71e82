"""PipelineParallelGrid and ring/naive allreduce on real gloo ranks."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from overlap.testing import RankPool
from tests.gloo import topology_cases as tc


def test_pipe_data_grid_matches_deepspeed(pools: Callable[[int], RankPool]) -> None:
    res = pools(4).run(tc.grid_2x2, timeout=60)
    # PipeDataParallelTopology(2, 2): rank = pipe * 2 + data
    assert [x["stage"] for x in res] == [0, 0, 1, 1]
    assert [x["dp_id"] for x in res] == [0, 1, 0, 1]
    assert [x["dp_group"] for x in res] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [x["pp_group"] for x in res] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [x["first"] for x in res] == [True, True, False, False]
    assert [x["last"] for x in res] == [False, False, True, True]
    assert [x["dp_sum"] for x in res] == [1, 1, 5, 5]
    assert [x["pp_sum"] for x in res] == [2, 4, 2, 4]
    assert res[0]["p2p"] == [[0, 2], [1, 3], [2, 0], [3, 1]]
    assert [x["next_stage"] for x in res] == [2, 3, 2, 3]
    assert res[3]["mpu"] == [1, 2, 1, 2, 1, 2, 0, 1]
    # every group of more than one rank on every rank (model-parallel, data and pipe: two
    # each, as DeepSpeed's), and only its own one-rank slice group, never one per rank
    assert [x["groups_created"] for x in res] == [7] * 4, [x["groups_created"] for x in res]


def test_grid_without_a_pipe_axis(pools: Callable[[int], RankPool]) -> None:
    assert pools(3).run(tc.grid_without_pipe_axis, timeout=60) == [[0, 3], [1, 3], [2, 3]]


def test_a_rank_with_another_topology_is_refused_on_every_rank(
    pools: Callable[[int], RankPool],
) -> None:
    for got, dp_sum in pools(4).run(tc.grid_other_topology, timeout=60):
        assert got.startswith(
            "PipelineParallelGrid: ranks [3] built another topology than rank 0"
        ), got
        assert dp_sum == "2"


def test_grid_honours_process_group(pools: Callable[[int], RankPool]) -> None:
    res = pools(4).run(tc.grid_on_a_process_group, timeout=60)
    assert res[0] is None
    assert res[1:] == [[0, [1, 2, 3], 1, 3], [1, [1, 2, 3], 1, 3], [2, [1, 2, 3], 1, 3]]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("algorithm", ["ring", "naive"])
def test_ring_and_naive_equal_native(
    pools: Callable[[int], RankPool], world_size: int, algorithm: str
) -> None:
    assert (
        pools(world_size).run(tc.allreduce_algorithms, algorithm, "blocking", timeout=120)
        == [35] * world_size
    )


@pytest.mark.parametrize("mode", ["wait", "uvloop", "asyncio"])
@pytest.mark.parametrize("algorithm", ["ring", "naive"])
def test_ring_and_naive_async(pools: Callable[[int], RankPool], algorithm: str, mode: str) -> None:
    assert pools(3).run(tc.allreduce_algorithms, algorithm, mode, timeout=120) == [35] * 3


def test_grid_groups_take_async_multi_phase_ops_diloco_and_schedulers(
    pools: Callable[[int], RankPool],
) -> None:
    res = pools(4).run(tc.grid_groups_take_every_op, timeout=120)
    # data-parallel groups [0, 1] and [2, 3]: sums 1 and 5, 1-bit means 1.5 and 3.5
    assert [x[0] for x in res] == [1.0, 1.0, 5.0, 5.0], res
    assert [x[1] for x in res] == [1.5, 1.5, 3.5, 3.5], res
    assert [x[2] for x in res] == [[0.5, 0.5]] * 2 + [[2.5, 2.5]] * 2, res
    assert all(x[3] for x in res), res
