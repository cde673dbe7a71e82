"""BucketScheduler on CUDA with NCCL (one rank, one GPU): DDP-equal gradients, side streams,
allocator safety."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from overlap.testing import RankPool
from tests.gpu import nccl_cases as nc


@pytest.mark.parametrize("mode", ["blocking", "uvloop", "asyncio"])
def test_gradients_equal_ddp(nccl: RankPool, mode: str) -> None:
    assert nccl.run(nc.scheduler_equals_ddp, "none", mode, timeout=120) == [0.0]


def test_gradient_as_bucket_view_equals_ddp(nccl: RankPool) -> None:
    assert nccl.run(nc.scheduler_equals_ddp, "none", "blocking", True, timeout=120) == [0.0]


@pytest.mark.parametrize("compression", ["fp16", "onebit"])
def test_compressed_gradients_are_close(nccl: RankPool, compression: str) -> None:
    # one rank: fp16 rounds each gradient; 1-bit keeps only signs and one scale per segment,
    # so only the fp16 error is small enough to bound tightly.
    (worst,) = nccl.run(nc.scheduler_equals_ddp, compression, "blocking", timeout=120)
    assert worst < (1e-3 if compression == "fp16" else 1.0), worst


def test_no_sync_accumulation_equals_ddp(nccl: RankPool) -> None:
    assert nccl.run(nc.no_sync_equals_ddp, timeout=120) == [0.0]


def test_buckets_run_on_the_side_stream_and_compute_waits(nccl: RankPool) -> None:
    (r,) = nccl.run(nc.side_stream_wait, timeout=120)
    assert r["correct"], r
    assert r["on_side_stream"] and r["side_streams"] == 1, r
    # the compute stream waited for every bucket's sleep (they run one after another)
    assert r["gpu_ms"] >= 0.9 * r["buckets"] * r["sleep_ms"], r


def test_without_the_wait_the_read_is_wrong(nccl: RankPool) -> None:
    """Negative control: the case above can fail, and does when the wait is removed."""
    (r,) = nccl.run(nc.side_stream_wait, True, timeout=120)
    assert not r["correct"], r


def test_record_stream_keeps_in_flight_buckets_safe(nccl: RankPool) -> None:
    assert nccl.run(nc.record_stream_stress, 20, timeout=120) == [0]


def test_without_record_stream_memory_is_reused_in_flight(nccl: RankPool) -> None:
    """Negative control: the same churn without record_stream corrupts the result, so the
    stress test above would catch a missing record_stream."""
    (bad,) = nccl.run(nc.record_stream_stress, 5, False, timeout=120)
    assert bad > 0


def test_scheduler_under_allocation_churn(nccl: RankPool) -> None:
    assert nccl.run(nc.scheduler_churn, 12, timeout=180) == [0.0]


def test_onebitadam_standalone_on_cuda_matches_the_reference(nccl: RankPool) -> None:
    from tests.gloo import onebit_adam_cases as oc

    assert nccl.run(oc.standalone_matches_reference, "blocking", "cuda", timeout=120) == [oc.STEPS]


def test_onebitadam_overlapped_on_cuda_matches_the_reference(nccl: RankPool) -> None:
    """Momentum formed and 1-bit reduced on the side stream, rebuilt into exp_avg."""
    from tests.gloo import onebit_adam_cases as oc

    (parts,) = nccl.run(oc.overlapped_matches_reference, "blocking", "cuda", timeout=120)
    assert len(parts) > 1


def test_hierarchical_reduction_runs_on_nccl(nccl: RankPool) -> None:
    """Regression: Hierarchical made its control tensors on the CPU, which NCCL refuses."""
    (r,) = nccl.run(nc.hierarchical_on_nccl, timeout=120)
    assert r["none_err"] == 0.0, r
    assert r["raise"] == ["ok finite=True", "NonFiniteError", "ok finite=True"], r
    assert r["skip"] == ["ok finite=True", "skipped", "ok finite=True"], r


@pytest.mark.parametrize("mode", ["blocking", "uvloop"])
@pytest.mark.parametrize("compression", ["none", "int8"])
def test_streaming_diloco_on_nccl_equals_gloo(
    nccl: RankPool, pools: Callable[[int], RankPool], compression: str, mode: str
) -> None:
    """DiLoCo's reductions had run on gloo and on MPI with CUDA tensors, never on NCCL: the
    same run on a CUDA model over NCCL and on a CPU model over gloo (a process of its own)."""
    (gpu,) = nccl.run(nc.diloco_run, compression, mode, "cuda", timeout=120)
    (cpu,) = pools(1).run(nc.diloco_run, compression, mode, "cpu", timeout=120)
    for r in (gpu, cpu):
        assert r["apart"] == 0.0, r["stats"]  # after finish() the weights are the global ones
        assert r["stats"]["inner_steps"] == 10 and r["stats"]["in_flight"] == [], r["stats"]
    assert gpu["stats"]["syncs"] == cpu["stats"]["syncs"] >= 4, (gpu["stats"], cpu["stats"])
    worst = max(
        float((p - q).abs().max()) / (float(q.abs().max()) or 1.0)
        for p, q in zip(gpu["params"], cpu["params"], strict=True)
    )
    # Int8: CUDA's rounding can move a value across a code boundary (1/127 of a block's max)
    assert worst < (1e-4 if compression == "none" else 2e-2), worst
    # the BatchNorm's buffers went through finish()'s buffer sync on each backend
    mean_g, var_g, count_g = gpu["buffers"]
    mean_c, var_c, count_c = cpu["buffers"]
    assert int(count_g) == int(count_c) == 10
    assert torch.allclose(mean_g, mean_c, rtol=2e-2, atol=1e-4), (mean_g, mean_c)
    assert torch.allclose(var_g, var_c, rtol=2e-2, atol=1e-4), (var_g, var_c)
