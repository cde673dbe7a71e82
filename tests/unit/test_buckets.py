"""Bucket layout: which gradients DDP's uncompressed path reduces on their own."""

from __future__ import annotations

import torch

from overlap.scheduler.buckets import Bucket


def _bucket(sizes: list[int]) -> Bucket:
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return Bucket(0, params, offsets, torch.zeros(sum(sizes)))


def test_large_tensors_go_solo_and_each_run_of_small_ones_is_one_span() -> None:
    b = _bucket([18, 3, 36, 6])  # bytes: 72, 12, 144, 24
    b.plan_solo(64)
    assert b.solo == (0, 2)
    assert b.rest == ((18, 21), (57, 63))
    b = _bucket([3, 6, 36, 2, 2])
    b.plan_solo(64)
    assert b.solo == (2,) and b.rest == ((0, 9), (45, 49))  # consecutive small ones merge


def test_no_large_tensor_keeps_the_bucket_one_op() -> None:
    b = _bucket([18, 3])
    b.plan_solo(1 << 20)
    assert b.solo == () and b.rest == ()
    b.plan_solo(1)  # every tensor large: no spans
    assert b.solo == (0, 1) and b.rest == ()
