"""overlap.bench.memory: the pre-flight memory check of `overlap bench train`."""

from __future__ import annotations

from overlap.bench import memory
from overlap.bench.train import ALL_VARIANTS, VARIANTS, model_params


def test_every_variant_has_a_measured_figure() -> None:
    assert set(memory.BYTES_PER_PARAM) == set(ALL_VARIANTS)


def test_the_default_run_estimates_what_was_measured() -> None:
    """The default 2-rank run peaked at 4,600,948 KiB a rank (docs/benchmarks.md,
    "Memory"); the per-variant figures are rounded up, so the estimate is a little more."""
    each = memory.train_rank_bytes(VARIANTS, model_params(25.2))
    measured = 4_600_948 * 1024
    assert measured <= each <= 1.05 * measured, each / measured
    assert model_params(25.2) == 6 * (2048 * 2048 + 2048)


def test_a_run_that_does_not_fit_is_named_with_the_fixes() -> None:
    have = memory.available_bytes()
    assert have is not None and have > 0  # Linux: /proc/meminfo
    assert memory.train_shortfall(["compute"], 1000, 1) is None
    ranks = have // memory.train_rank_bytes(VARIANTS, model_params(25.2)) + 1
    msg = memory.train_shortfall(VARIANTS, model_params(25.2), int(ranks))
    assert msg is not None and msg.startswith(f"these {ranks} ranks would need about "), msg
    assert "9 variants of a 25.2M-parameter model" in msg, msg
    assert msg.endswith("or fewer ranks (--world-size, --hosts, --procs-per-host)"), msg


def test_the_demo_checks_its_model_size() -> None:
    have = memory.available_bytes()
    assert have is not None
    assert memory.demo_shortfall("medium", 2) is None
    ranks = int(have // memory.DEMO_RANK_BYTES["large"]) + 1
    msg = memory.demo_shortfall("large", ranks)
    assert msg is not None and "GiB each: every variant of the large model)" in msg, msg
    assert msg.endswith("Use a smaller --model-size or fewer ranks (--world-size)"), msg


def test_bench_ops_estimates_its_buffers() -> None:
    """Measured (2 ranks, 256 MiB): all_reduce 504,356 KiB, all_gather 1,549,056 KiB; the
    estimate is a little above each."""
    mib = 1 << 20
    ar = memory.ops_rank_bytes(["all_reduce"], 256 * mib, 2)
    ag = memory.ops_rank_bytes(["all_reduce", "all_gather"], 256 * mib, 2)
    assert 504_356 * 1024 <= ar <= 1.2 * 504_356 * 1024, ar
    assert 1_549_056 * 1024 <= ag <= 1.1 * 1_549_056 * 1024, ag
    assert memory.ops_shortfall(["all_reduce"], 4, 2) is None
    msg = memory.ops_shortfall(["all_gather"], 1 << 40, 2)
    assert msg is not None and "the buffers of all_gather at 1048576 MiB" in msg, msg
