"""DiLoCo and Streaming DiLoCo on real gloo ranks, against DiLoCo from the math; the Int8
and FP8 quantizers; checkpoints, faults and refusals."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from overlap.testing import RankPool
from tests.gloo import diloco_cases as dc

ALL = [[0, 1, 2, 3, 4]]


@pytest.mark.parametrize("world_size", [2, 3])
def test_diloco_equals_the_math_for_several_h(
    pools: Callable[[int], RankPool], world_size: int
) -> None:
    """fragments=1, delay=0 is DiLoCo exactly: H=1, 4 and 8 over 20 steps (20, 5, 2 syncs)."""
    out = pools(world_size).run(dc.matches_reference, [1, 4, 8], timeout=120)
    assert out == [[[ALL, [0], 20], [ALL, [0], 5], [ALL, [0], 2]]] * world_size


@pytest.mark.parametrize(
    ("outer", "fragments", "delay"), [("sgd", 1, 0), ("dampened", 1, 0), ("sgd", 2, 1)]
)
def test_int8_quantizes_each_parameter_of_a_fragment_on_its_own_scales(
    pools: Callable[[int], RankPool], outer: str, fragments: int, delay: int
) -> None:
    # the bias's change over one sync was 16% off the uncompressed run's when its blocks
    # ran into a weight's (fused landing, one fragment); on blocks of its own 0.9%
    errs = pools(2).run(dc.int8_per_parameter_error, outer, fragments, delay, timeout=120)
    assert errs[0] == errs[1]
    assert max(errs[0]) < 0.03, errs[0]


@pytest.mark.parametrize(
    ("hs", "frags", "delay", "mode", "alpha", "want"),
    [
        # H=4, 2 fragments: [0,1,2] syncs at 2, 6, ..., [3,4] at 4, 8, ...; 10 syncs in 20
        ([4], 2, 1, "blocking", 0.0, [[[[0, 1, 2], [3, 4]], [2, 0], 10]]),
        # H=6: offsets 3 and 0; the merge keeps half of the local weights
        ([6], 2, 0, "blocking", 0.5, [[[[0, 1, 2], [3, 4]], [3, 0], 6]]),
        # H=8, 3 fragments, 2 steps of delay, the paper's merge, awaited in an event loop
        ([8], 3, 2, "async", 0.5, [[[[0, 1, 2], [3], [4]], [2, 5, 0], 7]]),
    ],
)
def test_streaming_schedule_and_merge_equal_the_math(
    pools: Callable[[int], RankPool],
    hs: list[int],
    frags: int,
    delay: int,
    mode: str,
    alpha: float,
    want: list[object],
) -> None:
    out = pools(2).run(dc.matches_reference, hs, frags, delay, mode, 20, alpha, timeout=120)
    assert out == [want] * 2


@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_background_reductions_run_at_the_lowest_priority_and_equal_the_math(
    pools: Callable[[int], RankPool], mode: str
) -> None:
    """``background=True``: every streaming reduction runs on a thread at nice 19 (while
    the rank's training thread stays at 0) and the run is still DiLoCo's math: H=8, 3
    fragments, 2 steps of delay, the paper's merge (7 syncs in 20 steps)."""
    out = pools(2).run(
        dc.matches_reference, [8], 3, 2, mode, 20, 0.5, None, "fused", False, False, 0.0, True,
        timeout=120,
    )  # fmt: skip
    assert out == [[[[[0, 1, 2], [3], [4]], [2, 5, 0], 7, 19]]] * 2


@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_streaming_equals_the_math_when_the_pass_is_slow(
    pools: Callable[[int], RankPool], mode: str
) -> None:
    """A streaming sync's pseudo-gradient is taken on the pass thread while the training
    thread goes on: held up 30 ms each, the inner optimizer's next step must wait for it
    (it would otherwise write the weights first, and the result would not be the math).
    Every pass of the 7 syncs ran on that thread."""
    out = pools(2).run(
        dc.matches_reference, [8], 3, 2, mode, 20, 0.5, None, "fused", False, False, 0.03,
        timeout=120,
    )  # fmt: skip
    assert out == [[[[[0, 1, 2], [3], [4]], [2, 5, 0], 7, 7]]] * 2


def test_a_weight_written_while_its_pass_reads_it_is_refused(
    pools: Callable[[int], RankPool],
) -> None:
    err, unchanged, waited = pools(2).run(dc.write_during_a_pass_is_refused, timeout=120)[0]
    assert err.startswith("RuntimeError: parameter 3 (shape (1,), fragment 1) was written in"), err
    assert "DiLoCo.step() and the inner optimizer's next step()" in err, err
    assert unchanged and waited


def test_torch_landing_equals_the_math(pools: Callable[[int], RankPool]) -> None:
    """An outer optimizer the fused landing does not take (an LR scheduler patches its
    ``step``) lands through ``outer.step()``: the same DiLoCo."""
    out = pools(2).run(
        dc.matches_reference, [4], 2, 1, "blocking", 12, 0.5, None, "torch", timeout=120
    )
    assert out == [[[[[0, 1, 2], [3, 4]], [2, 0], 6]]] * 2


def test_parameters_that_are_not_contiguous_equal_the_math(
    pools: Callable[[int], RankPool],
) -> None:
    """A channels_last convolution's weight is not contiguous: DiLoCo takes rank 0's
    weights, syncs and lands such parameters as it does any other (it refused them, in the
    broadcast that starts it). Two fragments, streamed: the strided one lands through
    ``outer.step()``, the other fused, both against the contiguous reference."""
    out = pools(2).run(
        dc.matches_reference, [4], 2, 1, "blocking", 12, 0.5, None, "fused", True, timeout=120
    )
    assert out == [[[[[0, 1, 2], [3, 4]], [2, 0], 6]]] * 2


def test_a_frozen_parameter_is_skipped_and_refused_once_unfrozen(
    pools: Callable[[int], RankPool],
) -> None:
    """Optimizers built over ``model.parameters()`` hold the model's frozen parameters too
    (they skip them: no gradient), the usual way to build one. DiLoCo refused them ("the
    inner_optimizer updates parameters that are not this model's trainable parameters:
    build it over model.parameters()"). Now the run equals the math, the frozen parameter
    stays as it was, and once unfrozen step() refuses: no fragment holds it, so the ranks
    would train it apart."""
    out = pools(2).run(
        dc.matches_reference,
        [4],
        2,
        1,
        "blocking",
        12,
        0.0,
        None,
        "fused",
        False,
        True,
        timeout=120,
    )
    for r in (0, 1):
        (frags, offs, syncs, still, unfrozen) = out[r][0]
        assert [frags, offs, syncs, still] == [[[0, 1, 2], [3, 4]], [2, 0], 6, True], out[r]
        assert unfrozen.startswith(
            "ValueError: 'still' did not require grad when this DiLoCo was built and now do: "
            "the DiLoCo was built without them and does not average them"
        ), unfrozen
        assert "call remove() and build a new DiLoCo over the model" in unfrozen, unfrozen


def test_on_a_subgroup_equals_the_math(pools: Callable[[int], RankPool]) -> None:
    want = [[[[0, 1, 2], [3, 4]], [2, 0], 6]]  # 6 syncs in 12 steps
    finished = [[1], True, True, 0]  # as on the world (test_finish_...)
    got = pools(3).run(dc.on_a_subgroup, timeout=120)
    assert got == [[want, finished], [want, finished], None], got


def test_astep_returns_while_the_reduction_is_in_flight(pools: Callable[[int], RankPool]) -> None:
    seen = pools(2).run(dc.astep_returns_while_in_flight, timeout=120)
    assert seen == [[[], [0], [], [1], [], [0], [], [1]]] * 2


@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_landings_that_keep_waiting_are_said_once_with_the_fix(
    pools: Callable[[int], RankPool], mode: str
) -> None:
    """A rank 60 ms behind every step makes the other's landings wait for its issues: that
    rank logs one warning naming the cause and the fix (three windows were late); the slow
    rank, whose reductions are there when it lands, and a run with no slow rank say
    nothing."""
    slow = pools(2).run(dc.late_landings_said, 1, mode, timeout=120)
    assert len(slow[0]) == 1 and slow[1] == [], slow
    msg = slow[0][0]
    assert "fragment reductions arrive late" in msg and "raise sync_every" in msg, msg
    assert "delay=2 steps" in msg and "behind the others" in msg, msg
    assert pools(2).run(dc.late_landings_said, -1, mode, timeout=120) == [[], []]


def test_global_weights_swap_in_and_back(pools: Callable[[int], RankPool]) -> None:
    """The agreed model is evaluable mid-run, with a fragment in flight; nothing is lost."""
    out = pools(2).run(dc.global_weights_swap, timeout=120)
    assert out == [[True, [1], True, True, True, True, True, 10]] * 2


def test_syncs_allocate_nothing_new(pools: Callable[[int], RankPool]) -> None:
    """Int8 keeps 12 buffers per fragment, all made when DiLoCo is built; the fused
    landing's momentum buffers are the spares made then too."""
    assert pools(2).run(dc.syncs_allocate_nothing_new, timeout=120) == [[[12, 12], True, 0]] * 2


@pytest.mark.parametrize("compression", ["none", "int8"])
def test_resume_mid_flight_is_bit_identical(
    pools: Callable[[int], RankPool], compression: str
) -> None:
    assert pools(2).run(dc.resume_is_bit_identical, compression, timeout=120) == [True, True]


@pytest.mark.parametrize(("kind", "worst", "drift"), [("int8", 0.01, 0.05), ("fp8", 0.07, 0.25)])
def test_quantized_average_is_close_and_error_feedback_keeps_it_unbiased(
    pools: Callable[[int], RankPool], kind: str, worst: float, drift: float
) -> None:
    """One call is within the code's resolution; over 30 calls the running sum of outputs
    stays within about one call's error of the exact running sum (errors carried, not
    accumulated)."""
    for w in (2, 3):
        res = pools(w).run(dc.quantized_reduce, kind, 1000, 64, timeout=120)
        assert res[0] == res[-1], res
        assert 0 < res[0][0] < worst and res[0][1] < drift, res


@pytest.mark.parametrize(("kind", "bound"), [("int8", 0.03), ("fp8", 0.08)])
def test_quantizers_work_as_bucket_compression(
    pools: Callable[[int], RankPool], kind: str, bound: float
) -> None:
    out = pools(2).run(dc.quantized_in_scheduler, kind, timeout=120)
    (first, mean), other = out[0], out[1]
    assert out[0] == other and 0 < first < bound, out  # every rank the same result
    assert mean < first / 2, out  # error feedback: the mean over 6 steps is closer


@pytest.mark.parametrize("compression", ["none", "int8", "int8-skip", "onebit-skip"])
def test_nonfinite_pseudo_gradient_leaves_global_weights(
    pools: Callable[[int], RankPool], compression: str
) -> None:
    out = pools(2).run(dc.nonfinite_leaves_globals, compression, timeout=120)
    assert out == [["NonFiniteError", True, True]] * 2


@pytest.mark.parametrize("call", ["step", "finish"])
def test_peer_death_during_sync_is_comm_error_globals_whole(call: str) -> None:
    timeout = 10.0
    pool = RankPool(2, timeout=timeout).start()
    try:
        res = pool.run(dc.peer_dies_during_sync, timeout, call, timeout=120, expect_dead=(1,))
    finally:
        pool.close()
    kind, seconds, cause, whole, in_flight = res[0]
    assert kind == "CommError" and seconds < timeout + 5, res
    assert cause not in ("NoneType", "") and whole and in_flight == [], res


def test_ranks_exit_cleanly_after_syncs_on_the_driver() -> None:
    """A torch optimizer plus a reduction on a driver thread used to abort both ranks at
    exit ("terminate called without an active exception"): the driver thread outlived
    destroy_process_group. It is joined there now."""
    pool = RankPool(2, timeout=60).start()
    try:
        pool.run(dc.matches_reference, [2], steps=4, timeout=120)
    finally:
        codes = pool.close()
    assert codes == {0: 0, 1: 0}, codes


@pytest.mark.parametrize(
    ("h", "frags", "delay", "steps", "alpha", "landing", "mode", "due"),
    [
        # DiLoCo ending on a sync step: nothing to sync, finish() is flush()
        (4, 1, 0, 8, 0.0, "fused", "blocking", []),
        # two steps past the last sync: the one fragment syncs once more
        (4, 1, 0, 10, 0.0, "fused", "blocking", [0]),
        # H=4, 2 fragments (offsets 2, 0), delay 1: fragment 1 landed at step 9, fragment 0
        # at 7 and trained since
        (4, 2, 1, 9, 0.0, "fused", "blocking", [0]),
        # step 10: fragment 0, issued at 10, is in flight and lands in finish(); fragment 1
        # trained since its landing at 9; the same through astep() and afinish()
        (4, 2, 1, 10, 0.0, "fused", "blocking", [1]),
        (4, 2, 1, 10, 0.0, "fused", "async", [1]),
        # with the paper's merge a landing keeps the local weights apart: both sync; and
        # through outer.step() (an LR scheduler on the outer optimizer)
        (4, 2, 1, 9, 0.5, "fused", "blocking", [0, 1]),
        (4, 2, 1, 10, 0.5, "torch", "async", [0, 1]),
    ],
)
def test_finish_ends_every_rank_on_one_model_that_equals_the_math(
    pools: Callable[[int], RankPool],
    h: int,
    frags: int,
    delay: int,
    steps: int,
    alpha: float,
    landing: str,
    mode: str,
    due: list[int],
) -> None:
    out = pools(2).run(
        dc.finish_ends_on_one_model, h, frags, delay, steps, alpha, landing, mode, timeout=120
    )
    assert out == [[due, True, True, 0]] * 2


def test_finish_with_int8_ends_every_rank_on_the_same_bits(
    pools: Callable[[int], RankPool],
) -> None:
    assert pools(2).run(dc.finish_with_int8, timeout=120) == [[[0], True, True]] * 2


@pytest.mark.parametrize(("delay", "mode"), [(1, "blocking"), (0, "async")])
def test_a_tracer_sees_each_fragment_sync(
    pools: Callable[[int], RankPool], tmp_path: Path, delay: int, mode: str
) -> None:
    out = pools(2).run(dc.traced_syncs, delay, mode, str(tmp_path / "t.json"), timeout=120)
    # H=4, offsets 2 and 0: fragment 0 issues at 2 and 6, fragment 1 at 4 and 8 (with a
    # delay of 1 that one lands in flush())
    lands = [2, 4, 6, 8] if delay == 0 else [3, 5, 7, 9]
    for got in out:
        assert sorted(got["reduce"]) == sorted(
            [(0, 2, lands[0]), (1, 4, lands[1]), (0, 6, lands[2]), (1, 8, lands[3])]
        ), got
        assert got["issue"] == 4 and got["wait"] == 4 and got["land"] == 4, got
        assert got["took"] == ((4, True) if delay else (0, True)), got
        assert got["steps"] == 8 and got["comm"] and got["ordered"] and got["wait_s"], got
        assert got["report_buckets"] == [0, 1] and got["exported"], got


def test_bad_input_is_refused_with_the_fix(pools: Callable[[int], RankPool]) -> None:
    out = pools(2).run(dc.refusals, timeout=120)
    want = {
        "sync_every": "ValueError: sync_every must be an int >= 1, got 0",
        "delay": "ValueError: delay=4 must be less than sync_every=4",
        "fragments": "ValueError: fragments=6 but the model has 5 trainable parameters",
        "outer_other": "ValueError: the outer_optimizer updates parameters that are not",
        "outer_part": "ValueError: the outer_optimizer covers 2 of the model's 5",
        "inner_other": "ValueError: the inner_optimizer updates parameters that are not",
        "alpha": "ValueError: alpha must be in [0, 1), got 1.0",
        "auto": "ValueError: compression=Auto chooses by timing a BucketScheduler's steps",
        "string": "TypeError: compression takes a Compressor such as overlap.Int8()",
        "tracer": "TypeError: tracer must be an overlap.Tracer, got str",
        "pass_thread": "TypeError: pass_thread must be True, False or None (auto), got 1",
        "hooks": "0",
        "lazy": "ValueError: 0.weight is not initialised yet (a lazy module such as "
        "nn.LazyLinear has no shape before its first forward): run one forward pass, then "
        "build the DiLoCo",
        "after_scheduler": "ValueError: this model's gradients are averaged by a "
        "BucketScheduler over ranks [0, 1], and this DiLoCo's group (ranks [0, 1]) shares "
        "ranks [0, 1] with it",
        "scheduler_after": "ValueError: these parameters are already reduced by a DiLoCo",
        "load_other": "ValueError: this state has sync_every=8 but this DiLoCo has sync_every=16",
        "load_outer_groups": "ValueError: this state's outer optimizer has parameter groups "
        "of [2, 3] parameters but this DiLoCo's has [5]",
        "removed": "RuntimeError: this DiLoCo was removed",
        "finish_inside": "RuntimeError: the model holds the global weights (inside `with "
        "diloco.global_weights():`)",
        "finish_removed": "RuntimeError: this DiLoCo was removed",
        "differs": "ValueError: DiLoCo differs across ranks: ranks [1]",
        "load_mixed_steps": "ValueError: DiLoCo.load_state_dict: the ranks' states are of "
        "different saves (steps 0 to 3)",
        "steps_after_refusals": "3",
        "steps_after_load": "0",
        "other_compression": "ValueError: DiLoCo's settings differ across ranks: ranks [1] "
        "passed another compression than rank 0",
        "other_outer": "ValueError: DiLoCo's settings differ across ranks: ranks [1] passed "
        "another outer_optimizer than rank 0",
    }
    assert out[0]["load_refused_on_one"].startswith(
        "ValueError: DiLoCo.load_state_dict: another rank of the group refused its state"
    ), out[0]
    assert out[1]["load_refused_on_one"].startswith("ValueError: this state has sync_every=8")
    for r in (0, 1):
        out[r].pop("load_refused_on_one")
        assert set(out[r]) == set(want)
        for k, v in want.items():
            assert out[r][k].startswith(v), (r, k, out[r][k])


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_int8_lands_from_its_codes_as_the_decoded_average_does(
    pools: Callable[[int], RankPool], alpha: float
) -> None:
    assert pools(2).run(dc.int8_lands_from_its_codes, alpha, timeout=120) == [True, True]


@pytest.mark.parametrize(("frags", "delay"), [(1, 0), (2, 1)])
def test_a_cancelled_astep_keeps_the_global_weights_agreed(
    pools: Callable[[int], RankPool], frags: int, delay: int
) -> None:
    out = pools(2).run(dc.cancelled_astep_keeps_the_globals_agreed, frags, delay, timeout=120)
    assert out[0][-1] is True and out[1][-1] is True, out
    assert any("timeout" in str(x) for x in out[0]), out  # it did cancel


def test_a_parameter_assigned_after_building_is_refused(
    pools: Callable[[int], RankPool],
) -> None:
    for out in pools(2).run(dc.assigned_after_build, timeout=60):
        assert out[0].startswith(
            "'2.weight' was assigned a new Parameter after this DiLoCo was built: the DiLoCo "
            "was built without them and does not average them"
        ), out
        assert out[1] == "0.5", out  # rebuilt: the new weight is synced


def test_a_model_cast_after_building_is_refused_at_its_sync(
    pools: Callable[[int], RankPool],
) -> None:
    for out in pools(2).run(dc.cast_after_build, timeout=60):
        assert out[:2] == ["ok", "ok"], out  # no sync due: nothing to refuse yet
        assert out[2].startswith(
            "parameter 0 is now torch.float64 on cpu, but it was torch.float32 on cpu when "
            "this DiLoCo was built"
        ), out
        assert out[3] == "2", out  # the refused step was not counted


def test_workers_of_several_ranks_average_inside_and_sync_across(
    pools: Callable[[int], RankPool],
) -> None:
    # hierarchical DiLoCo: a BucketScheduler per worker of 2 ranks, a DiLoCo per rank
    # position across the 2 workers; against the reference step by step (2 syncs in 8
    # steps at H = 3). Before: the DiLoCo was refused ("already averaged"), and the
    # schedulers over the two workers' groups hung every rank on gloo.
    out = pools(4).run(dc.workers_of_several_ranks, timeout=120)
    for r, got in enumerate(out):
        assert got["syncs"] == 2, (r, got)
        assert got["finished_buffers"] == [[1.5] * 3, 10], (r, got)  # the mean of 0..3
        assert got["scheduler_on_top"].startswith(
            "ValueError: these parameters are already reduced by a DiLoCo"
        ), (r, got)
        assert "build the BucketScheduler first" in got["scheduler_on_top"], (r, got)
        assert got["second_scheduler"].startswith(
            "ValueError: these parameters are already reduced by a BucketScheduler"
        ), (r, got)
        mates = [0, 1] if r < 2 else [2, 3]
        assert got["same_ranks"].startswith(
            f"ValueError: this model's gradients are averaged by a BucketScheduler over "
            f"ranks {mates}, and this DiLoCo's group (ranks {mates}) shares"
        ), (r, got)


@pytest.mark.parametrize("frags", [1, 2])
def test_a_float64_model_syncs_in_float64(pools: Callable[[int], RankPool], frags: int) -> None:
    """The pseudo-gradients of a float64 model are float64: its syncs are exact to float64
    (they were rounded to float32, 6e-11 off on a 1e-3 step)."""
    out = pools(2).run(dc.float64_sync, frags, timeout=60)
    assert all(o[0] == ["torch.float64"] and o[1] < 1e-15 for o in out), out


def test_an_unawaited_astep_is_named_at_the_next_call(pools: Callable[[int], RankPool]) -> None:
    """`diloco.astep()` without await never ran, and a loop of them never synced (the ranks
    drifted apart, with only Python's warning). The next call now raises, naming it; an
    asyncio.gather of asteps is not mistaken for one."""
    want = ["diloco.astep() was called but never ran", True, True]
    assert pools(2).run(dc.unawaited_astep, timeout=60) == [want] * 2
