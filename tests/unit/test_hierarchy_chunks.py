"""The pure parts of the hierarchical reduction: how a bucket's tensors fall into chunks."""

from __future__ import annotations

import pytest
import torch

from overlap.scheduler.hierarchy import chunk_segments


def _shapes(*sizes: int) -> list[torch.Size]:
    return [torch.Size([k]) for k in sizes]


@pytest.mark.parametrize(
    ("sizes", "per", "want"),
    [
        # 2 chunks of 6 over tensors of 4, 5, 3: the second tensor is cut between them
        ((4, 5, 3), 6, [[4, 2], [3, 3]]),
        # 3 chunks of 4 over 10 elements: the last holds 2 elements and 2 of padding
        ((7, 3), 4, [[4], [3, 1], [2, 2]]),
        # a chunk wholly past the bucket is all padding
        ((1, 1), 1, [[1], [1], [1]]),
    ],
)
def test_chunks_follow_the_tensors_and_pad_apart(
    sizes: tuple[int, ...], per: int, want: list[list[int]]
) -> None:
    n = sum(sizes)
    got = [chunk_segments(_shapes(*sizes), n, per, j) for j in range(len(want))]
    assert got == want
    assert all(sum(s) == per for s in got)


def test_one_segment_without_shapes_that_describe_the_bucket() -> None:
    assert chunk_segments(None, 10, 5, 0) == [5]
    assert chunk_segments(_shapes(10), 10, 5, 1) == [5]  # one tensor: one scale anyway
    assert chunk_segments(_shapes(4, 5), 10, 5, 0) == [5]  # 9 elements, not the bucket's 10
    # matrices count by their elements
    assert chunk_segments([torch.Size([2, 3]), torch.Size([4])], 10, 5, 0) == [5]
    assert chunk_segments([torch.Size([2, 3]), torch.Size([4])], 10, 5, 1) == [1, 4]
