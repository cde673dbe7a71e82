"""The 1-bit compressed allreduce and the compressors on real gloo ranks."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from overlap.testing import RankPool
from tests.gloo import compression_cases as cc


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("n", [1, 37, 1001])  # none is a multiple of 8W
def test_onebit_equals_reference_bitwise(
    pools: Callable[[int], RankPool], world_size: int, n: int
) -> None:
    firsts = pools(world_size).run(cc.onebit_matches_reference, n, "blocking", timeout=120)
    assert all(f == firsts[0] for f in firsts)


@pytest.mark.parametrize("mode", ["wait", "uvloop", "asyncio"])
def test_onebit_async_forms(pools: Callable[[int], RankPool], mode: str) -> None:
    pools(3).run(cc.onebit_matches_reference, 100, mode, timeout=120)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_onebit_half_precision_buffers(pools: Callable[[int], RankPool], dtype: str) -> None:
    pools(2).run(cc.onebit_matches_reference, 77, "blocking", dtype, timeout=120)


def test_onebit_world_size_one(pools: Callable[[int], RankPool]) -> None:
    pools(1).run(cc.onebit_matches_reference, 5, "blocking", timeout=60)


def test_nan_leaves_state_untouched_on_every_rank(pools: Callable[[int], RankPool]) -> None:
    assert pools(3).run(cc.nan_leaves_state_untouched, timeout=60) == [[2], [2], [2]]


@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_powersgd_keeps_a_non_finite_input_out_of_its_state(
    pools: Callable[[int], RankPool], mode: str
) -> None:
    want = ["raised" if mode == "raise" else "skipped", True, True, True, True]
    assert pools(3).run(cc.powersgd_nonfinite, mode, timeout=60) == [want] * 3


def test_zero_size_is_a_noop_and_bad_input_is_refused(pools: Callable[[int], RankPool]) -> None:
    msgs = pools(2).run(cc.zero_size_and_bad_input, timeout=60)[0]
    assert msgs[0].startswith("ValueError: worker_error must be a float32 tensor of 16")
    assert "padded_numel(10, 2)" in msgs[0]
    assert msgs[1].startswith("TypeError: compressed_allreduce takes float32, float16 or")
    assert msgs[2].startswith("ValueError: buffer is not contiguous")


@pytest.mark.parametrize("name", ["onebit", "powersgd", "fp16", "bf16", "none"])
def test_compressor_state_dict_resumes_bit_identically(
    pools: Callable[[int], RankPool], name: str
) -> None:
    assert pools(2).run(cc.compressor_resume_is_bit_identical, name, timeout=60) == [True] * 2


def test_compressed_training_converges_close_to_uncompressed(
    pools: Callable[[int], RankPool],
) -> None:
    pool = pools(2)
    losses = {
        name: pool.run(cc.train, name, timeout=300)[0]
        for name in ("none", "fp16", "onebit", "powersgd")
    }
    base = losses["none"]
    assert base < 0.5, losses  # the problem is learnable
    assert losses["fp16"] < base * 1.1 + 1e-3, losses
    assert losses["onebit"] < base * 3 + 0.05, losses
    assert losses["powersgd"] < base * 3 + 0.05, losses


def test_per_tensor_scales_consistent_and_nan_safe(pools: Callable[[int], RankPool]) -> None:
    outs = pools(3).run(cc.segmented_onebit_is_consistent, timeout=60)
    assert outs[0] == outs[1] == outs[2]


@pytest.mark.parametrize("world_size", [2, 3])
def test_numba_and_torch_codecs_agree(pools: Callable[[int], RankPool], world_size: int) -> None:
    """The CPU kernels against the torch codec (the CUDA path, run on CPU)."""
    worst = pools(world_size).run(cc.codecs_agree, timeout=120)
    assert max(worst) < 1e-6, worst


def test_extreme_but_finite_magnitudes_are_compressed(pools: Callable[[int], RankPool]) -> None:
    ratios = pools(2).run(cc.extreme_magnitudes_stay_finite, timeout=60)
    assert all(0.1 < x < 10 for rank in ratios for x in rank), ratios


def test_fp16_keeps_the_share_of_a_value_above_its_range(pools: Callable[[int], RankPool]) -> None:
    for rank in pools(2).run(cc.fp16_share_of_a_spike, timeout=60):
        assert all(abs(v - 5e4) <= 32 for v in rank), rank  # float16 spacing at 5e4 is 32


def test_powersgd_keeps_a_float64_bucket_in_float64(pools: Callable[[int], RankPool]) -> None:
    """Full rank, so the result is the average: float64-exact (float32 was 1e-7 off)."""
    out = pools(2).run(cc.powersgd_float64, timeout=60)
    assert all(o[0] == "torch.float64" and o[1] < 1e-13 for o in out), out


def test_an_async_block_quantized_reduce_counts_the_bytes_as_laid_out(
    pools: Callable[[int], RankPool],
) -> None:
    for nbytes, laid_out, as_one_run in pools(2).run(cc.block_quantized_handle_bytes, timeout=60):
        assert nbytes == laid_out > as_one_run, (nbytes, laid_out, as_one_run)
