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


def test_a_published_chunk_rebuilds_into_any_destination() -> None:
    """Hierarchical._rebuild: float32 contiguous destinations are written by the codec in
    place, the others (another dtype, a strided view) through the scratch chunk; every one
    gets the codec's own rebuild of the published bits."""
    from overlap.compression.codec import codec_for
    from overlap.compression.layout import layout
    from overlap.scheduler.hierarchy import Hierarchical, _compressed_form

    per, segments = 64, [24, 30, 10]
    lay = layout(per, 2, 0, segments)
    g = torch.Generator().manual_seed(0)
    signs = torch.randint(0, 256, (lay.P // 8,), dtype=torch.uint8, generator=g)
    sscales = torch.rand(lay.w, lay.nseg, generator=g) + 0.5
    room = torch.zeros(per)
    form = _compressed_form(room, lay)
    assert form is not None
    form[0].copy_(sscales)
    form[1].copy_(signs)
    want = torch.empty(per)
    codec_for(want.device).rebuild(signs, sscales, lay, want)

    a0 = 100  # the chunk's first element within the bucket
    plain = torch.full((24,), -1.0)
    half = torch.full((20,), -1.0, dtype=torch.bfloat16)
    strided = torch.full((20, 2), -1.0)[:, 0]
    dests = [(a0, a0 + 24, plain), (a0 + 24, a0 + 44, half), (a0 + 44, a0 + 64, strided)]
    h = object.__new__(Hierarchical)  # _rebuild uses only its scratch
    h._pad = None
    h._rebuild(room, lay, dests, a0)
    assert torch.equal(plain, want[:24])
    assert torch.equal(half, want[24:44].to(torch.bfloat16))
    assert torch.equal(strided, want[44:64])
