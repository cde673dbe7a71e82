"""BucketScheduler on real gloo ranks: DDP-equal gradients, overlap, compression, errors."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from overlap.testing import RankPool
from tests.conftest import SHORT_TIMEOUT, needs_amp_grad_scaler
from tests.gloo import scheduler_cases as sc


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("mode", ["blocking", "uvloop", "asyncio"])
def test_gradients_equal_ddp(pools: Callable[[int], RankPool], world_size: int, mode: str) -> None:
    assert pools(world_size).run(sc.equals_ddp, mode, timeout=120) == [3] * world_size


@pytest.mark.parametrize("mode", ["blocking", "uvloop"])
def test_large_gradients_reduced_in_place_equal_ddp(
    pools: Callable[[int], RankPool], mode: str
) -> None:
    # DDP's path with the large gradients reduced in .grad (no bucket copy in or back):
    # a gradient present on one rank only, a float64 one and tied weights included
    assert pools(2).run(sc.equals_ddp, mode, False, 3, 512, timeout=120) == [3, 3]


@pytest.mark.parametrize("mode", ["blocking", "uvloop"])
def test_a_compiled_model_equals_ddp(pools: Callable[[int], RankPool], mode: str) -> None:
    # torch.compile(model) given to the scheduler and trained: its backward graph
    # accumulates the .grads that the scheduler's hooks bucket, as the eager model's do
    assert pools(2).run(sc.equals_ddp, mode, False, 3, 0, True, timeout=180) == [3, 3]


@pytest.mark.parametrize("block", [1024, 64])
def test_int8_quantizes_each_tensor_of_a_bucket_on_its_own_scales(
    pools: Callable[[int], RankPool], block: int
) -> None:
    # the bias (300 floats, 10x smaller gradients) shares a bucket with the weights: with
    # blocks across tensors it came back 7-11% off the exact mean at block 1024 (the
    # layer-2 weight's scale), 1.4-3.5% at 64; with a block of its own 0.7-1.2%
    errs = pools(2).run(sc.int8_per_tensor_error, block, timeout=120)
    assert errs[0] == errs[1]
    for step in errs[0]:
        assert max(step) < 0.03, errs[0]
        assert step[1] < 0.015, errs[0]  # the bias


def test_int8_across_hosts_quantizes_each_piece_of_a_chunk_on_its_own_scales(
    pools: Callable[[int], RankPool],
) -> None:
    # 2 hosts x 2: each host's chunk of the bucket goes across hosts as Int8, its tensor
    # pieces each on blocks of their own (before, in one run of blocks: the bias 8% off)
    errs = pools(4).run(sc.int8_per_tensor_error, 1024, 2, timeout=120)
    assert all(e == errs[0] for e in errs)
    for step in errs[0]:
        assert max(step) < 0.03, errs[0]


def test_gradient_as_bucket_view_equals_ddp(pools: Callable[[int], RankPool]) -> None:
    assert pools(2).run(sc.equals_ddp, "blocking", True, timeout=120) == [3, 3]


def test_a_user_compressor_of_the_original_signature_still_works(
    pools: Callable[[int], RankPool],
) -> None:
    # the scheduler passed ``outputs=`` to every compressor, failing one written before it
    # (found on a GPU run: TypeError from tests/gpu's own compressor)
    assert min(pools(2).run(sc.user_compressor_equals_ddp, timeout=60)) >= 2


@pytest.mark.parametrize("solo_bytes", [0, 64])
def test_no_sync_accumulation_equals_ddp(pools: Callable[[int], RankPool], solo_bytes: int) -> None:
    # 64: the accumulated weights are reduced in place in .grad
    assert pools(2).run(sc.no_sync_equals_ddp, solo_bytes, timeout=60) == [True, True]


@pytest.mark.parametrize(
    ("last_uses_b", "as_view", "mode"),
    [("rank 1", False, "blocking"), ("none", False, "await"), ("rank 1", True, "await"),
     ("none", True, "blocking")],
)  # fmt: skip
def test_a_parameter_only_no_sync_used_is_averaged_as_ddp(
    pools: Callable[[int], RankPool], last_uses_b: str, as_view: bool, mode: str
) -> None:
    out = pools(2).run(sc.no_sync_branch_equals_ddp, last_uses_b, as_view, mode, timeout=60)
    assert out == [[True], [True]]


@pytest.mark.parametrize(
    ("as_view", "compression"), [(False, "none"), (True, "none"), (False, "fp16")]
)
def test_grads_kept_between_steps_are_averaged_as_ddp(
    pools: Callable[[int], RankPool], as_view: bool, compression: str
) -> None:
    out = pools(2).run(sc.kept_grads_equal_ddp, as_view, compression, timeout=60)
    assert out == [[True], [True]]


@pytest.mark.parametrize("name", ["none", "fp16"])
def test_each_bucket_is_copied_back_as_soon_as_it_lands(
    pools: Callable[[int], RankPool], name: str
) -> None:
    # none: DDP's inline path; fp16: the worker thread's
    assert min(pools(2).run(sc.copy_back_as_each_bucket_lands, name, timeout=60)) > 0


def test_first_bucket_collective_starts_before_backward_ends(
    pools: Callable[[int], RankPool],
) -> None:
    pools(2).run(sc.first_bucket_starts_before_backward_ends, timeout=120)


def test_compressed_training_converges(pools: Callable[[int], RankPool]) -> None:
    pool = pools(2)
    losses = {
        n: pool.run(sc.train_with, n, timeout=300)[0]
        for n in ("none", "fp16", "onebit", "powersgd")
    }
    base = losses["none"]
    assert base < 0.5, losses
    assert losses["fp16"] < base * 1.1 + 1e-3, losses
    assert losses["onebit"] < base * 3 + 0.05, losses
    assert losses["powersgd"] < base * 3 + 0.05, losses


def test_checkpoint_resume_is_bit_identical(pools: Callable[[int], RankPool]) -> None:
    assert pools(2).run(sc.resume_is_bit_identical, timeout=120) == [True, True]


def test_bad_input_is_refused_clearly(pools: Callable[[int], RankPool]) -> None:
    res = pools(2).run(sc.bad_inputs, timeout=120)
    for r, out in enumerate(res):
        assert out["sparse_module"].startswith(
            "TypeError: the model (Embedding) has sparse=True, so its gradient is sparse"
        ), out
        assert out["sparse_flag"] == "no error", out  # only torch's embeddings are refused
        assert out["sparse"].startswith("TypeError: BucketScheduler got a sparse gradient"), r
        assert out["sync_without_backward"].startswith(
            "RuntimeError: synchronize() was called but no rank produced a gradient"
        ), out
        assert (
            "a second backward produced a gradient before synchronize()" in out["second_backward"]
        ), out
        assert out["second_backward_ended"].startswith("IncompleteBackwardError"), out
        assert "use_reentrant=False" in out["reentrant_checkpoint"], out
        assert "IncompleteBackwardError" in out["reentrant_checkpoint_ended"], out
        assert out["reentrant_checkpoint_fixed"] == "True", out
        assert out["different_models"].startswith(
            "ValueError: the parameters differ across ranks: ranks [1]"
        ), out
        settings = "ValueError: the BucketScheduler's settings differ across ranks: ranks [1] "
        assert out["other_compression"].startswith(settings + "passed another compression "), out
        assert out["other_average"].startswith(settings + "passed another average "), out
        assert out["other_dtype_and_cap"].startswith(
            settings + "passed another bucket_cap_mb, reduce_dtype than rank 0"
        ), out
        assert "several devices" in out["several_devices"], out
        assert "no parameter requires grad" in out["nothing_to_reduce"], out
        assert out["hierarchy_one_host"].startswith(
            "ValueError: hierarchy='node' needs several hosts with several processes each, "
            "but the job is on one host"
        ), out
        assert "must be 'auto', 'flat' or 'node', got 'nodes'" in out["hierarchy_name"], out
        assert out["auto_on_one_host"] == "False", out
        assert out["lazy"].startswith(
            "ValueError: 0.weight is not initialised yet (a lazy module such as nn.LazyLinear "
            "has no shape before its first forward): run one forward pass, then build the "
            "BucketScheduler"
        ), out
        # before: int()'s "cannot convert float NaN to integer"
        assert out["cap_nan"] == (
            "ValueError: bucket_cap_mb must be a finite number > 0, got nan"
        ), out


def test_a_layer_unfrozen_after_building_is_refused_not_left_unaveraged(
    pools: Callable[[int], RankPool],
) -> None:
    res = pools(2).run(sc.unfrozen_after_build, timeout=120)
    named = "ValueError: '0.weight', '0.bias' did not require grad when this BucketScheduler "
    assert res[1]["one_rank"].startswith(named), res[1]
    assert res[0]["one_rank"].startswith(
        "ValueError: rank 1 unfroze parameters that did not require grad when the "
        "BucketScheduler was built"
    ), res[0]
    for r, out in enumerate(res):
        assert "call remove() and build a new BucketScheduler" in out["one_rank"], out
        assert "dropped on every rank" in out["one_rank"], out
        assert out["every_rank"].startswith(named), (r, out)
        assert out["refrozen_averaged"] is True, (r, out)
        assert out["rebuilt_averaged"] is True, (r, out)


def test_parameters_assigned_after_building_are_refused_not_left_unaveraged(
    pools: Callable[[int], RankPool],
) -> None:
    res = pools(2).run(sc.assigned_after_build, timeout=120)
    assert res[1]["one_rank"].startswith(
        "ValueError: '2.weight' was assigned a new Parameter after this BucketScheduler was built"
    ), res[1]
    assert res[0]["one_rank"].startswith("ValueError: rank 1 unfroze parameters"), res[0]
    assert "or assigned new ones into the model" in res[0]["one_rank"], res[0]
    for r, out in enumerate(res):
        assert "dropped on every rank" in out["one_rank"], (r, out)
        assert out["restored_averaged"] is True, (r, out)
        for k in ("bias_still_new", "bias_still_new_again"):
            assert out[k].startswith(
                "ValueError: '2.bias' was assigned a new Parameter after this BucketScheduler"
            ), (r, k, out)
        assert out["same_and_frozen_averaged"] is True, (r, out)
        assert out["new_unfrozen"].startswith(
            "ValueError: '0.bias' did not require grad when this BucketScheduler was built"
        ), (r, out)
        assert out["new_module"].startswith(
            "ValueError: '2.weight' was assigned a parameter of the new submodule '2'; "
            "'2.bias' was assigned a parameter of the new submodule '2' after this "
            "BucketScheduler was built"
        ), (r, out)
        assert out["rebuilt_averaged"] is True, (r, out)


def test_restore_into_another_world_size_or_model_is_refused(
    pools: Callable[[int], RankPool],
) -> None:
    states = pools(2).run(sc.saved_states, timeout=60)[0]
    res = pools(3).run(sc.restore_elsewhere, states, timeout=60)
    for out in res:
        assert "saved on 2 ranks but this group has 3" in out["sched"], out
        assert "state is for 2 ranks but its group has 3" in out["onebit"], out
        assert "other parameter shapes" in out["shapes"], out


@pytest.mark.parametrize("reduce_dtype", [None, "float32"])
def test_bf16_gradients_reduce_in_their_dtype_or_fp32(
    pools: Callable[[int], RankPool], reduce_dtype: str | None
) -> None:
    res = pools(2).run(sc.low_precision_grads, reduce_dtype, timeout=60)
    assert res[0] == res[1] == [4.5, 4.5]


def test_onebit_buckets_pipeline_into_the_gradients(pools: Callable[[int], RankPool]) -> None:
    out = pools(2).run(sc.onebit_into_grads_equals_the_compressor, timeout=120)
    # rank 0 has no gradient for `branch` (zeros, copied back); rank 1 writes them all
    assert 0 < out[0]["direct"] < out[1]["direct"], out
    # every gradient written directly was also read in place (no copy into the bucket)
    assert [o["in_place"] for o in out] == [o["direct"] for o in out], out
    # pipelined: bucket k is compressed before bucket k-1's server step (its phase 2)
    stages = out[0]["stages"]
    assert out[0]["buckets"] >= 3, out
    assert stages[:3] == ["compress bucket 0", "compress bucket 1", "server step bucket 0"]
    assert stages.index("compress bucket 2") < stages.index("server step bucket 1")


@pytest.mark.parametrize("mode", ["blocking", "uvloop"])
def test_a_nonfinite_step_leaves_the_scheduler_usable(
    pools: Callable[[int], RankPool], mode: str
) -> None:
    out = pools(2).run(sc.nonfinite_step_leaves_the_scheduler_usable, mode, timeout=120)
    want = ["ok", "NonFiniteError [1]", "ok", "ok"]
    assert out == [want, want], out


@needs_amp_grad_scaler
@pytest.mark.parametrize(
    ("name", "mode"),
    [
        ("none", "blocking"),
        ("onebit", "blocking"),
        ("onebit", "uvloop"),
        ("powersgd", "blocking"),
        ("int8", "blocking"),
        ("auto", "blocking"),
        ("hierarchical", "blocking"),
    ],
)
def test_grad_scaler_skips_an_overflow_on_every_rank_as_under_ddp(
    pools: Callable[[int], RankPool], name: str, mode: str
) -> None:
    """Regression: with on_nonfinite="skip" the ranks whose own gradient was finite kept
    it, so the scaler stepped there and skipped on the rank that overflowed (weights that
    differ, silently); PowerSGD had no check at all and kept the NaN in its warm-start
    state, so every later step was NaN too and the scale halved for ever (as under torch's
    own powerSGD_hook). Now a skipped step is NaN on every rank, and the state untouched."""
    out = pools(2).run(sc.grad_scaler_as_ddp, name, mode, timeout=120)
    want = [1024.0] * 3 + [512.0] * 4  # the overflow halves the scale once, then it holds
    for o in out:
        assert o["ddp"] == want and o["sched"] == want, out
        assert o["same"] and o["finite"], out
    if name == "none":
        assert out[0]["from_ddp"] < 1e-6, out
    if name == "auto":
        assert out[0]["at_overflow"] == "onebit", out


@pytest.mark.parametrize(
    ("ranks", "on_nonfinite", "step1"),
    [(2, "raise", "NonFiniteError"), (2, "skip", "skipped"), (3, "raise", "NonFiniteError")],
)
def test_a_nonfinite_chunk_of_a_hierarchical_bucket_is_agreed_by_the_host(
    pools: Callable[[int], RankPool], ranks: int, on_nonfinite: str, step1: str
) -> None:
    """Regression: the NaN reached one rank's chunk only; that rank raised and left the step
    a barrier early (the others then failed with CommError, and every later step too), or,
    with "skip", it alone said last_skipped while the others stepped on gradients it had
    never published."""
    out = pools(ranks).run(
        sc.nonfinite_step_leaves_the_scheduler_usable, "blocking", True, on_nonfinite, timeout=120
    )
    assert out == [["ok", step1, "ok", "ok"]] * ranks, out


@pytest.mark.parametrize(
    ("ranks", "layout", "as_view"),
    [(2, "hosts", False), (2, "local", False), (3, "local", False), (3, "local", True)],
)
def test_hierarchical_pipelines_buckets_each_in_its_own_region(
    pools: Callable[[int], RankPool], ranks: int, layout: str, as_view: bool
) -> None:
    """Regression: pipelined buckets once named their shared regions alike (the same file
    for two buckets, then a failed unlink on one rank and a collective mismatch). Also the
    exchange inside a host for 1, 2 and 3 ranks per host (each averages its own chunk from
    its gradients and the others' slots), from the gradients or from the bucket."""
    out = pools(ranks).run(
        sc.hierarchical_pipelined_equals_the_average, layout, as_view, timeout=120
    )
    for err, buckets, regions, direct, in_place in out:
        assert err < 1e-6 and buckets >= 3 and regions == buckets, out
        # every parameter: no bucket copy either way (with .grad the bucket, none needed)
        want = 0 if as_view else 6
        assert direct == in_place == want, out


@pytest.mark.parametrize(("ranks", "layout"), [(2, "hosts"), (2, "local"), (3, "local")])
def test_hierarchical_onebit_rebuilt_from_published_signs_is_bitwise_the_same(
    pools: Callable[[int], RankPool], ranks: int, layout: str
) -> None:
    """Each chunk's owner publishes its 1-bit result (signs and scales) and every rank of
    the host rebuilds every chunk straight into its gradients: the same bits as the owner
    rebuilding the floats for the others to copy, on every step, with a padded last chunk
    (3 ranks) and with a 1-bit exchange between hosts (2 "hosts"). Each chunk has scales
    per tensor piece, as a flat reduction has per tensor."""
    out = pools(ranks).run(sc.hierarchical_onebit_publishes_what_it_rebuilt, layout, timeout=120)
    for equal, published, buckets, _ in out:
        # 4 steps equal, and every chunk of every bucket was published on each
        assert equal == 4 and buckets >= 3, out
        assert published == 4 * buckets, out
    # a bucket of several tensors: a chunk across them has a scale per tensor piece (and one
    # for the padding), not one for the whole chunk
    assert max(most for *_, most in out) >= 3, out


def test_hierarchical_onebit_averages_a_two_rank_host_inside_the_encode(
    pools: Callable[[int], RankPool],
) -> None:
    """Two ranks a host: each rank's 1-bit chunk is the mean of its gradients and the peer's
    slot, taken inside the encode pass: bitwise the chunk a written-out mean gives, on
    exact gradients, over several buckets and steps."""
    out = pools(2).run(sc.hierarchical_fused_mean_is_the_unfused_one, timeout=120)
    for equal, buckets in out:
        assert equal == 3 and buckets >= 3, out


def test_hierarchical_hosts_with_and_without_shared_memory_stay_in_step(
    pools: Callable[[int], RankPool],
) -> None:
    """A host without room in /dev/shm goes through sockets while the others use shared
    memory (each rank its own host here, so every reduction is an exchange between hosts):
    the pipelined buckets' exchanges stay paired and the result is the average. The socket
    host takes as many phases as a region costs the others (empty ones)."""
    out = pools(2).run(sc.hierarchical_pipelined_equals_the_average, "hosts", False, 0, timeout=120)
    (err0, buckets, regions0, _, _), (err1, _, regions1, _, _) = out
    assert err0 < 1e-6 and err1 < 1e-6 and buckets >= 3, out
    assert regions0 == 0 and regions1 == buckets, out


@pytest.mark.parametrize(
    ("where", "hierarchical"),
    [("start", False), ("between", False), ("start", True), ("after", False)],
)
def test_an_error_on_one_rank_stops_every_rank_with_no_wrong_gradient(
    short_pool: RankPool, where: str, hierarchical: bool
) -> None:
    """Regression: one rank's own error inside a bucket's reduction ended that bucket there,
    and the rank went on with the other buckets, whose collectives then paired with other
    buckets' on its peer: the peer's synchronize() returned gradients summed across the
    wrong buckets as a normal result. Now the failing rank issues nothing more, its peer
    fails at the (short) timeout, and every later step raises OutOfStepError at once."""
    out = short_pool.run(
        sc.one_rank_failure_stops_every_rank, where, SHORT_TIMEOUT, hierarchical, timeout=90
    )
    if where == "after":
        # rank 0 fails after its last collective in step 0: rank 1's step ends, then its
        # rebuild broadcast times out (before, every later backward of rank 1 then raised
        # "a second backward produced a gradient")
        assert out[0] == ["RuntimeError"] + ["OutOfStepError"] * 3, out
        assert out[1] == ["CommError"] + ["OutOfStepError"] * 3, out
        return
    assert out[0] == ["ok", "RuntimeError", "OutOfStepError", "OutOfStepError"], out
    assert out[1] == ["ok", "CommError", "OutOfStepError", "OutOfStepError"], out


def test_a_compressor_bug_on_every_rank_stops_every_rank_at_once(short_pool: RankPool) -> None:
    """Regression: when every rank's reduction failed alike at a bucket's first phase, a rank
    whose worker failed before the step's vote skipped the vote, and a peer already in it
    waited there until the job's timeout (here 5 s; 30 minutes by default): measured at the
    first of 30 trials. Now a rank stopped by its own error in the step still votes, with a
    bit that says so, and every rank stops at once."""
    out = short_pool.run(sc.every_rank_fails_alike, 30, timeout=120)
    for trial in zip(*out, strict=True):
        kinds = [kind for kind, _ in trial]
        assert "TypeError" in kinds and set(kinds) <= {"TypeError", "CommError"}, out
        assert max(seconds for _, seconds in trial) < SHORT_TIMEOUT / 2, out


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_cancelled_wait_cancels_the_wait_not_the_step(
    pools: Callable[[int], RankPool], loop: str
) -> None:
    out = pools(2).run(sc.cancelled_wait_leaves_the_step_running, loop, timeout=120)
    want = ["ok", "timeout", "ok", "timeout", "remove refused", "ok"]
    assert out[0] == [*want, "timeout", "remove refused", "ok", "ok"], out
    assert out[1] == ["ok"] * 5, out


@pytest.mark.parametrize(
    ("mode", "compression", "skip"),
    [
        ("blocking", "none", False),
        ("blocking", "onebit", False),
        ("blocking", "none", True),
        ("uvloop", "onebit", False),
    ],
)
def test_a_backward_that_raises_on_one_rank_drops_the_step_on_every_rank(
    pools: Callable[[int], RankPool], mode: str, compression: str, skip: bool
) -> None:
    out = pools(2).run(sc.failed_backward_drops_the_step, mode, compression, skip, timeout=120)
    dropped = "IncompleteBackwardError [0]"
    if skip:
        first = ["boom in backward", "refused", dropped]
    elif mode == "blocking":
        first = ["boom in backward", dropped]
    else:
        first = ["boom in backward"]  # await sched.backward() raises the backward's own error
    assert out[0] == ["ok", *first, "ok", "ok"], out
    assert out[1] == ["ok", dropped, "ok", "ok"], out


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_cancelled_backward_goes_on_and_the_next_wait_ends_its_step(
    pools: Callable[[int], RankPool], loop: str
) -> None:
    out = pools(2).run(sc.cancelled_backward_finishes_the_step, loop, timeout=120)
    assert out[0] == ["ok", "timeout", "refused", "ok", "ok"], out
    assert out[1] == ["ok"] * 3, out


@pytest.mark.parametrize("view", [False, True])
def test_casting_the_model_after_building_the_scheduler_is_refused(
    pools: Callable[[int], RankPool], view: bool
) -> None:
    for out in pools(2).run(sc.cast_after_build, view, timeout=60):
        assert out["error"].startswith("parameter 3 is now torch.float64 on cpu, but it was "
                                       "torch.float32"), out  # fmt: skip
        assert "then build the scheduler" in out["error"], out
        assert out["rebuilt"] is True, out


def test_ctrl_c_reaches_the_caller_and_stops_the_scheduler(short_pool: RankPool) -> None:
    out = short_pool.run(sc.interrupted_step, SHORT_TIMEOUT, timeout=90)
    check_interrupted_wait(out[0])
    # a gloo collective's wait is interrupted while the late peer is still away; a
    # receive's only once it has come (gloo cannot time a p2p wait out and go on)
    assert out[0]["all_reduce_s"] < sc.LATE_S / 2 and out[0]["irecv_s"] > sc.LATE_S / 2, out
    assert out[0]["blocking"] == "KeyboardInterrupt" and out[0]["blocking_s"] < sc.LATE_S / 2
    assert out[0]["blocking_after"] == [2.0, 2.0], out
    assert out[0]["steps"] == ["ok", "KeyboardInterrupt", "OutOfStepError"], out
    assert out[1]["steps"] == ["ok", "ok", "CommError"], out
    assert out[0]["after"] == out[1]["after"] == 2.0, out


def check_interrupted_wait(out: dict[str, object]) -> None:
    """Rank 0's side of scheduler_cases.interrupted_wait (also under MPI)."""
    assert out["all_reduce"] == out["irecv"] == "KeyboardInterrupt", out
    w = float(out["world"])  # type: ignore[arg-type]
    assert out["all_reduce_after"] == ("None", [w, w]), out
    assert out["irecv_after"] == ("None", [7.0, 7.0, 7.0]), out


@pytest.mark.parametrize("kind", ["scheduler", "diloco"])
def test_every_rank_starts_from_rank_0s_parameters_and_buffers(
    pools: Callable[[int], RankPool], kind: str
) -> None:
    """As DDP does at construction. Before, ranks seeded apart (DDP users do not seed: DDP
    broadcasts) kept their own weights: each applied the same averaged gradient to another
    model for ever, with no error. DiLoCo took rank 0's trainable weights only. Frozen
    layers, buffers and a weight that is not contiguous are included; init_sync=False
    leaves each rank's own."""
    names = ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias", "3.weight"]
    names += ["3.bias", "1.running_mean", "1.running_var", "1.num_batches_tracked"]
    for r, (built, stepped, contiguous) in enumerate(pools(3).run(sc.start_from_rank_0, kind)):
        assert built == [(n, True) for n in names], (r, built)
        if kind == "scheduler":  # the same averaged gradient on the same weights
            assert stepped == [(n, True) for n in names[:8]], (r, stepped)
        else:  # an inner step between syncs: trained apart, the frozen layer still equal
            assert [s for n, s in stepped if n.startswith("2.")] == [True, True], stepped
            assert not all(s for _, s in stepped), stepped
        assert not contiguous  # written back into the user's layout
    apart = pools(3).run(sc.start_from_rank_0, "scheduler", False)
    assert not all(s for _, s in apart[0][0]), apart[0][0]


@pytest.mark.parametrize("mode", ["blocking", "uvloop"])
def test_join_trains_uneven_inputs_as_ddp_join_does(
    pools: Callable[[int], RankPool], mode: str
) -> None:
    """Ranks with 2, 5 and 0 batches. Before join(), the rank with fewer batches left while
    its peers' next step waited for it until the timeout. Now the weights equal torch
    DDP's own Join (shadowed steps average with zeros over the world size), every rank
    ends with the same weights, and the scheduler goes on after the block."""
    out = pools(3).run(sc.join_equals_ddp_join, mode, [2, 5, 0], timeout=120)
    for r, (diff, shadowed, agreed) in enumerate(out):
        assert diff < 1e-6 and agreed, (r, out)
        assert shadowed == [3, 0, 5][r], (r, out)


def test_join_with_onebit_ends_with_the_same_weights(pools: Callable[[int], RankPool]) -> None:
    out = pools(2).run(sc.join_equals_ddp_join, "blocking", [4, 1], "onebit", timeout=120)
    assert [o[1:] for o in out] == [[0, True], [3, True]], out


def test_backward_with_create_graph_is_refused_with_the_fix(
    pools: Callable[[int], RankPool],
) -> None:
    for out in pools(2).run(sc.create_graph_backward, timeout=60):
        assert out["create_graph"].startswith(
            "ValueError: parameter 2's gradient is part of the autograd graph"
        ), out
        assert "torch.autograd.grad(..., create_graph=True)" in out["create_graph"], out
        # the last bias's gradient (a constant) went in first: the backward stopped halfway,
        # which the next synchronize() reports as such on every rank, readying the scheduler
        assert out["after"].startswith("IncompleteBackwardError: the backward of ranks 0, 1"), out
        assert out["penalty_exact"] is True, out


@pytest.mark.parametrize("compression", ["none", "onebit"])
def test_a_scheduler_per_data_parallel_group_averages_inside_it(
    pools: Callable[[int], RankPool], compression: str
) -> None:
    # 4 ranks, groups [0, 1] and [2, 3], each rank building its scheduler over its own at
    # once. Before: each rank made its scheduler's groups alone (new_group with its own
    # group's ranks, while the other group's ranks passed theirs) and every rank hung
    out = pools(4).run(sc.schedulers_per_subgroup, compression, timeout=120)
    for got in out:
        assert got["disagree"].startswith(
            "ValueError: BucketScheduler: the ranks disagree on their groups: ranks [0, 1, 2, "
            "3] are one group for some of them, but rank 0 gave ranks [0, 1]"
        ), got
        assert got["outside"].startswith(
            "ValueError: BucketScheduler: rank 2 was given the group of ranks [0, 1], which it "
            "is not a member of"
        ), got


def test_states_of_two_saves_are_refused_on_every_rank(pools: Callable[[int], RankPool]) -> None:
    out = pools(2).run(sc.load_mixed_saves, timeout=120)
    for r, got in enumerate(out):
        assert got["mixed"].startswith(
            "ValueError: BucketScheduler.load_state_dict: the ranks' states are of different "
            "saves (steps 1 to 2"
        ), got
        refused = got["refused_on_one"]
        if r == 1:
            assert refused.startswith("ValueError: this scheduler state was saved on 5"), got
        else:
            assert refused.startswith(
                "ValueError: BucketScheduler.load_state_dict: another rank of the group refused "
                "its state"
            ), got
        assert got["step_after_refusals"] == "2" and got["step_after_load"] == "1", got


@pytest.mark.parametrize("as_view", [False, True])
def test_a_second_backward_before_synchronize_drops_the_step(
    pools: Callable[[int], RankPool], as_view: bool
) -> None:
    """The second backward's gradient reached .grad (the bucket itself, as a view): the
    step is dropped on every rank, not ended with each rank's .grad another (as a view,
    it was, silently), and the next step is the average."""
    want = [
        "a second backward produced a gradient before synchronize()",
        "IncompleteBackwardError",
        True,
    ]
    assert pools(2).run(sc.second_backward_drops_the_step, as_view, timeout=60) == [want] * 2


@pytest.mark.parametrize(
    ("what", "as_view", "compression"),
    [
        ("clip", False, "none"),
        ("clip", True, "none"),
        ("zero", True, "none"),
        ("none", False, "none"),
        ("replace", False, "fp16"),
        ("clip", False, "onebit"),
        ("step", False, "none"),
        ("step", True, "onebit"),
    ],
)
def test_a_grad_changed_between_backward_and_synchronize_drops_the_step(
    pools: Callable[[int], RankPool], what: str, as_view: bool, compression: str
) -> None:
    """clip_grad_norm_, zero_grad(), a new .grad or optimizer.step() after backward and
    before synchronize(): every rank raises and the step is dropped (it was lost silently,
    or left the ranks with different gradients or weights), and the next step, done right,
    is the average."""
    out = pools(2).run(sc.grad_changed_before_synchronize, what, as_view, compression, timeout=60)
    want = "a .grad or a parameter changed between backward and synchronize() on ranks 0, 1 (here"
    assert [o[0] for o in out] == [want] * 2, out
    assert [o[1] for o in out] == [True, True], out


def test_an_unawaited_backward_is_named_at_the_next_call(
    pools: Callable[[int], RankPool],
) -> None:
    """`sched.backward(loss)` without await left .grad None silently (the model never
    trained). The next backward() now names the call that never ran, and the scheduler
    goes on; one kept by asyncio.gather runs."""
    want = ["sched.backward(loss) was called but never ran", True]
    assert pools(2).run(sc.unawaited_backward, timeout=60) == [want] * 2
