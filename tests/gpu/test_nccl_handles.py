"""Handles on NCCL: stream-ordered results, a loop that never blocks, GPU-timed traces."""

from __future__ import annotations

import pytest

from overlap.testing import RankPool
from tests.gpu import nccl_cases as nc


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_awaited_op_is_stream_ordered_and_never_blocks_the_loop(nccl: RankPool, loop: str) -> None:
    (r,) = nccl.run(nc.awaited_nccl_op, loop, timeout=120)
    assert r["value"] == r["expected"], r
    # The op waited for the sleeping kernel on the GPU (CUDA events) ...
    assert r["gpu_ms"] > 30, r
    # ... while the await returned without waiting for the GPU (contract 4) ...
    assert r["await_ms"] < r["gpu_ms"] / 2, r
    assert r["done_after"], r


def test_op_issued_on_a_side_stream_is_ordered_there(nccl: RankPool) -> None:
    assert nccl.run(nc.issued_on_side_stream, timeout=120) == [True]


def test_traced_scheduler_resolves_gpu_spans_for_the_report(nccl: RankPool) -> None:
    (r,) = nccl.run(nc.traced_scheduler_report, timeout=120)
    assert r["pending"] == 0, r
    assert r["device_spans"] >= 3, r  # at least one GPU-timed bucket span per step
    assert all(n.endswith("(GPU)") for n in r["device_names"]), r
    assert r["report"]["comm_ms"] > 0 and r["report_steps"] >= 3, r


def test_deepspeed_comm_additions_on_nccl(nccl: RankPool) -> None:
    (r,) = nccl.run(nc.ds_comm_on_cuda, timeout=120)
    assert all(r.values()), r
