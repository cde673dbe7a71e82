"""OneBitAdam on real gloo ranks: DeepSpeed's algorithm from the math, standalone and
overlapped, non-finite gradients, checkpoints and refusals."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from overlap.testing import RankPool
from tests.conftest import needs_amp_grad_scaler
from tests.gloo import onebit_adam_cases as oc


@pytest.mark.parametrize("world_size", [2, 3])
def test_standalone_matches_the_reference(
    pools: Callable[[int], RankPool], world_size: int
) -> None:
    assert (
        pools(world_size).run(oc.standalone_matches_reference, timeout=120)
        == [oc.STEPS] * world_size
    )


@pytest.mark.parametrize(("world_size", "mode"), [(2, "blocking"), (3, "blocking"), (2, "uvloop")])
def test_overlapped_matches_the_reference(
    pools: Callable[[int], RankPool], world_size: int, mode: str
) -> None:
    parts = pools(world_size).run(oc.overlapped_matches_reference, mode, timeout=120)
    assert all(p == parts[0] for p in parts) and len(parts[0]) > 1


@pytest.mark.parametrize("scheduled", [False, True])
def test_nonfinite_raises_on_every_rank_state_untouched(
    pools: Callable[[int], RankPool], scheduled: bool
) -> None:
    out = pools(2).run(oc.nonfinite, "raise", scheduled, timeout=120)
    seen = ["ok", "raised", "ok", "ok", "raised", "ok", "ok"]
    assert out == [[seen, 0, oc.STEPS - 2]] * 2


@pytest.mark.parametrize("scheduled", [False, True])
def test_nonfinite_skip_skips_on_every_rank(
    pools: Callable[[int], RankPool], scheduled: bool
) -> None:
    out = pools(2).run(oc.nonfinite, "skip", scheduled, timeout=120)
    seen = ["ok", "skipped", "ok", "ok", "skipped", "ok", "ok"]
    assert out == [[seen, 2, oc.STEPS - 2]] * 2


@needs_amp_grad_scaler
def test_grad_scaler_drives_it_on_every_rank(pools: Callable[[int], RankPool]) -> None:
    """Regression: torch.amp.GradScaler skipped step() on the rank whose gradient
    overflowed, and its peers' collective in step() waited for it until the timeout. The
    scaler now calls step() everywhere; the gradients are unscaled inside (the same
    weights as unscaled gradients give), an overflow on one rank skips the step on every
    rank, and the overlapped form, whose momentum is formed before a scaler could unscale
    it, is refused."""
    out = pools(2).run(oc.under_grad_scaler, timeout=120)
    for r, o in enumerate(out):
        assert o["diff"] == 0.0 and o["frozen"], out  # exact: a power-of-two scale
        assert o["skipped"] == [True, 1] and o["unchanged"], out
        assert o["scale"] == (128.0 if r == 1 else 256.0), out
        assert o["scheduled"].startswith("OneBitAdam attached to a BucketScheduler"), out
        assert o["scheduled_unchanged"], out


@pytest.mark.parametrize("scheduled", [False, True])
def test_resume_is_bit_identical(pools: Callable[[int], RankPool], scheduled: bool) -> None:
    assert pools(2).run(oc.resume_is_bit_identical, scheduled, timeout=120) == [True, True]


def test_bad_input_is_refused_with_the_fix(pools: Callable[[int], RankPool]) -> None:
    out = pools(2).run(oc.refusals, timeout=120)[0]
    want = {
        "freeze_negative": "ValueError: freeze_step must be >= 1, got -1",
        "freeze_zero": "ValueError: freeze_step must be >= 1, got 0",
        "non_float": "TypeError: OneBitAdam updates real floating-point parameters",
        "non_freeze": "ValueError: OneBitAdam does not support DeepSpeed's 'non_freeze'",
        "sparse": "TypeError: OneBitAdam does not support sparse gradients",
        "two_schedulers": "ValueError: this OneBitAdam is already reduced by another",
        "with_compression": "ValueError: optimizer=OneBitAdam does its own 1-bit compression",
        "step_without_sync": "RuntimeError: OneBitAdam.step() with a BucketScheduler",
        "uncovered_groups": "ValueError: the BucketScheduler reduces 4 parameters and this "
        "OneBitAdam updates 2",
        "other_lr": "ValueError: the BucketScheduler's settings differ across ranks: ranks [1] "
        "passed another optimizer than rank 0",
        "standalone_other_lr": "ValueError: OneBitAdam's settings differ across ranks: ranks "
        "[1] passed another hyperparameters (lr, betas",
        "standalone_other_lr_unchanged": "True",
        "standalone_other_freeze": "ValueError: OneBitAdam's settings differ across ranks: "
        "ranks [1] passed another freeze_step than rank 0",
        "standalone_other_freeze_unchanged": "True",
        "standalone_other_model": "ValueError: OneBitAdam: ranks [1] step other parameters",
        "standalone_other_model_unchanged": "True",
        "not_onebitadam": "TypeError: optimizer= takes an overlap.OneBitAdam, got Adam",
        "reduce_dtype": "ValueError: optimizer=OneBitAdam forms and reduces the momentum in "
        "float32 buckets, not torch.float16",
        "other_world": "ValueError: this OneBitAdam state was saved on 3 ranks but this job has 2",
        "other_model": "ValueError: this OneBitAdam state holds 5 parameters but the optimizer "
        "has 2",
        "other_shapes": "ValueError: parameter 2: the saved exp_avg has shape (4, 4)",
        "not_onebitadam_state": "ValueError: this is not a OneBitAdam state",
        "other_groups": "ValueError: this OneBitAdam state has parameter groups of [3, 2] "
        "parameters but the optimizer's are of [2, 3]",
        "mixed_saves": "ValueError: OneBitAdam.load_state_dict: the ranks' states are of "
        "different saves (steps 1 to 2)",
        "steps_after_mixed": "2",
        "steps_after_load": "1",
    }
    for name, start in want.items():
        assert out[name].startswith(start), (name, out[name])
