"""Hardening (issue #19): each scenario with real gloo processes, asserting the fixed behaviour."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from overlap.testing import RankPool, spawn_ranks
from tests.conftest import SHORT_TIMEOUT
from tests.gloo import hardening_cases as hc
from tests.polling import until


def test_any_number_of_outstanding_receives(pools: Callable[[int], RankPool]) -> None:
    n = 40  # the old waiter pool capped at 32 threads and deadlocked here
    res = pools(2).run(hc.many_outstanding_receives, n, timeout=120)
    assert res[0] == [10.0 * i for i in range(n)]


def test_destroy_fails_pending_handles() -> None:
    res = spawn_ranks(hc.destroy_fails_pending_handles, 2, timeout=60)
    assert res[0] == ["awaited: CommError", "untouched: CommError"]


def test_new_group_inherits_the_job_timeout() -> None:
    res = spawn_ranks(hc.new_group_inherits_timeout, 2, timeout=60)
    kind, seconds = res[0]
    assert kind == "CommError", res
    assert seconds < 7.5, res  # the peer came 8 s late: the 3 s job timeout applied


def test_requires_grad_leaf(pools: Callable[[int], RankPool]) -> None:
    for r, out in enumerate(pools(2).run(hc.requires_grad_leaf_ops, timeout=60)):
        assert out["avg"] == [out["expect_avg"]] * 3
        assert out["same_object"]
        assert out["reduce"] == ([3.0, 3.0] if r == 0 else [float(r + 1)] * 2)
        assert out["async_avg"] == [1.0, 1.0]
        assert out["ring"] == out["naive"] == [out["expect_avg"]] * 3
        assert out["async_ring"] == out["async_naive"] == [3.0] * 3


def test_last_skipped_covers_every_bucket(pools: Callable[[int], RankPool]) -> None:
    assert pools(2).run(hc.skip_flag_covers_every_bucket, timeout=120) == [[True, False]] * 2


def test_spawn_ranks_env_enables_debug_mode() -> None:
    assert spawn_ranks(hc.debug_enabled, 1, env={"OVERLAP_DEBUG": "1"}, timeout=60) == [True]


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_ranks_see_the_callers_environment_as_it_is_at_start(
    monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """A forked rank gets the caller's environment of now, not the fork server's of when it
    started (the first call may start the server; the second finds it running)."""
    import os

    monkeypatch.setenv("OVERLAP_TEST_GONE", "set")
    for mark, gone in (("first", "set"), ("second", None)):
        monkeypatch.setenv("OVERLAP_TEST_MARK", mark)
        own = {"OVERLAP_TEST_OWN": mark}
        got = spawn_ranks(hc.environment_seen, 2, env=own, start_method=method, timeout=60)
        assert [g[:3] for g in got] == [(mark, mark, gone)] * 2, got
        monkeypatch.delenv("OVERLAP_TEST_GONE", raising=False)
    parents = {g[3] for g in got}
    if method == "forkserver":  # forked by the server, which imported torch once
        assert os.getpid() not in parents, parents
    else:
        assert parents == {os.getpid()}


def test_a_rank_may_start_processes_of_its_own(pools: Callable[[int], RankPool]) -> None:
    # 2 ranks x (0 + 1 + 2 + 3) x 2 elements; daemonic ranks refused the DataLoader's workers
    assert pools(2).run(hc.data_loader_workers, timeout=60) == [24.0, 24.0]


def test_a_pool_left_open_does_not_hold_up_the_callers_exit(tmp_path: Path) -> None:
    """Non-daemonic ranks are joined at exit: the pool's finalizer must stop them first."""
    script = tmp_path / "left_open.py"
    script.write_text(
        "from overlap.testing import RankPool\n"
        "if __name__ == '__main__':\n"
        "    pool = RankPool(2, timeout=60).start()\n"
        "    print(pool.run(len, 'ab'), flush=True)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[2, 2]", done


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_ranks_end_when_the_pools_owner_is_killed(tmp_path: Path, method: str) -> None:
    """``kill -9`` of the process that owns a pool, its ranks busy in a call: the ranks end
    within seconds. Before, a forked rank's parent being the fork server (which lives while
    a rank does), nothing told them: after ``kill -9`` of ``overlap bench ops`` its ranks ran
    on at 60-70% of a core each, to the end of their loop."""
    import os
    import signal
    import time

    from overlap.runtime import pid_alive

    script = tmp_path / "owner.py"
    script.write_text(
        "import os, time\n"
        "from overlap.testing import RankPool\n"
        "if __name__ == '__main__':\n"
        f"    pool = RankPool(2, timeout=120, start_method={method!r}).start()\n"
        "    print(*pool.run(os.getpid), flush=True)\n"
        "    pool.run(time.sleep, 60)\n"
    )
    owner = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # multiprocessing's folder (the fork server's socket) is the killed owner's to
        # remove: in tmp_path, it goes with the test's other files
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert owner.stdout is not None
    ranks = [int(x) for x in owner.stdout.readline().split()]
    try:
        assert len(ranks) == 2 and all(pid_alive(p) for p in ranks), ranks
        time.sleep(0.5)  # the ranks are in their sleep
        owner.send_signal(signal.SIGKILL)  # the owner alone, as the OOM killer would
        owner.wait(timeout=30)
        until(lambda: not any(pid_alive(p) for p in ranks), 20, every=0.1)
        assert not [p for p in ranks if pid_alive(p)], "ranks outlived their pool's owner"
    finally:
        for p in [owner.pid, *ranks]:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass


def test_a_rank_that_hangs_shows_where(tmp_path: Path) -> None:
    """A rank that does not answer in time has its threads' stacks written to stderr before
    the pool stops it, so a hang seen once (in a CI run) shows where it was. Before, the
    RankError named the rank and nothing more."""
    script = tmp_path / "hangs.py"
    script.write_text(
        "import time\n"
        "from overlap import comm\n"
        "from overlap.testing import RankPool\n"
        "def stuck_here():\n"
        "    if comm.get_rank() == 1:\n"
        "        time.sleep(60)\n"
        "if __name__ == '__main__':\n"
        "    pool = RankPool(2, timeout=60).start()\n"
        "    try:\n"
        "        pool.run(stuck_here, timeout=3)\n"
        "    except Exception as e:\n"
        "        print(type(e).__name__, e, flush=True)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90)
    assert "RankError stuck_here: ranks [1] did not finish within 3 s" in done.stdout, done
    assert "line 6 in stuck_here" in done.stderr and "(most recent call first)" in done.stderr, done


def test_a_start_method_rank_pool_cannot_use_is_refused() -> None:
    for bad in ("fork", "threads"):
        with pytest.raises(ValueError, match=f"start_method='{bad}': RankPool starts ranks"):
            RankPool(2, start_method=bad)


def test_scheduler_lifecycle_refusals_and_release(pools: Callable[[int], RankPool]) -> None:
    cycles = 30
    for out in pools(2).run(hc.scheduler_lifecycle, cycles, timeout=180):
        assert out["second"].startswith(
            "these parameters are already reduced by a BucketScheduler"
        ), out
        assert "call remove() on it" in out["second"]
        assert "overlap.holder_of(model) returns it" in out["second"]
        assert out["lost"].startswith("these parameters are already reduced by a Bucket"), out
        assert out["found"] == ["BucketScheduler", True] and out["freed"] == [True] * 4, out
        assert out["shared_compressor"].startswith(
            "this OneBit is already used by a BucketScheduler"
        ), out
        (fd0, th0), (fd1, th1) = out["before"], out["after"]
        # 0.1.0: +10 fds and +5 threads per cycle (two gloo groups never freed)
        assert fd1 - fd0 <= 4 and th1 - th0 <= 2, out


def test_checkpoint_refusals_are_atomic_and_subgroups_restore(
    pools: Callable[[int], RankPool],
) -> None:
    res = pools(3).run(hc.checkpoint_refusals, timeout=120)
    assert res[0]["subgroup"] == res[1]["subgroup"] == "ok"
    for out in res:
        assert out["atomic"].startswith("this state is for the 'powersgd' compressor"), out
        assert out["unchanged"], out
        assert "saved with per_tensor_scales=True" in out["per_tensor"], out


def test_errors_name_the_call_and_the_group_stays_in_step(
    pools: Callable[[int], RankPool],
) -> None:
    for out in pools(2).run(hc.call_errors, timeout=120):
        assert out["int16"].startswith("TypeError: tensor is torch.int16, which gloo cannot"), out
        if hasattr(torch, "uint32"):  # torch 2.3 and later
            assert out["uint32_reduce"].startswith("TypeError: tensor is torch.uint32"), out
        assert out["float8"].startswith("TypeError: tensor is torch.float8_e4m3fn"), out
        assert out["scalar_gather"].startswith(
            "ValueError: all_gather_into_tensor: tensor is a 0-dim tensor"
        ), out
        assert out["scalar_scatter"].startswith(
            "ValueError: reduce_scatter: output is a 0-dim tensor"
        ), out
        assert out["empty_group"].startswith("ValueError: new_group: ranks is empty"), out
        assert out["string_group"] == (
            "TypeError: new_group: ranks must be a sequence of ints, got '01'"
        ), out
        assert out["float_group"].startswith(
            "TypeError: new_group: ranks must be ints (global ranks), got [0.0, 1.0]"
        ), out
        assert out["generator_group"] == 2.0, out
        assert out["reserved_tag"].startswith("ValueError: tag=20000 is reserved"), out
        assert out["payload_tag"].startswith("ValueError: tag=1073741824 is reserved"), out
        assert out["negative_tag"].startswith("ValueError: tag=-1 is negative"), out
        assert out["view_and_reduce_dtype"].startswith(
            "ValueError: gradient_as_bucket_view=True makes each .grad a view"
        ), out
        assert out["after"] == "[2.0, 2.0, 2.0]"
        assert out["ring"] == "[3.0, 3.0, 3.0, 3.0, 3.0]"
        assert out["user_tag"] == "[7.0]"


@pytest.mark.parametrize("world_size", [2, 3])
def test_multiphase_handles_finish_without_a_waiter(
    pools: Callable[[int], RankPool], world_size: int
) -> None:
    for out in pools(world_size).run(hc.multiphase_progress_without_waiter, timeout=120):
        assert out == {"polled": True, "callback": True, "after": [float(world_size)] * 2}


def test_background_jobs_keep_the_twins_order_at_the_lowest_priority(
    pools: Callable[[int], RankPool],
) -> None:
    for got, nices, caller in pools(2).run(hc.background_jobs_keep_their_order, timeout=60):
        assert got == [0.5, 10.5, 20.5, 30.5] and nices == [19, 19] and caller == 0


@pytest.mark.parametrize("background", [False, True])
def test_an_async_multiphase_op_that_fails_on_one_rank_stops_its_group(
    short_pool: RankPool, background: bool
) -> None:
    """Regression: async multi-phase ops run one after another on the group's private twin;
    one that raised on rank 0 only left rank 0's next op pairing its collectives with this
    op's on rank 1: both ranks returned averages of the wrong calls' tensors as normal
    results. Now the twin stops: the failing rank raises its error, its peer a CommError
    at the timeout, and later async ops on the group raise OutOfStepError, sending nothing.
    Bad arguments raise on the caller's thread and stop nothing."""
    out = short_pool.run(
        hc.async_multiphase_failure_on_one_rank, SHORT_TIMEOUT, background, timeout=90
    )
    assert out[0] == ["ValueError", "RuntimeError", "OutOfStepError", "OutOfStepError"], out
    assert out[1] == ["ValueError", "CommError", "OutOfStepError", "OutOfStepError"], out


@pytest.mark.parametrize("world_size", [2, 3])
def test_inputs_that_share_memory_with_outputs_give_the_right_result(
    pools: Callable[[int], RankPool], world_size: int
) -> None:
    for out in pools(world_size).run(hc.aliased_buffers, timeout=120):
        assert out and all(out.values()), out


def test_bad_object_collective_input_on_one_rank_fails_every_rank(
    pools: Callable[[int], RankPool],
) -> None:
    for r, out in enumerate(pools(2).run(hc.object_collectives_fail_on_every_rank, timeout=60)):
        check_object_failures(r, out)


def check_object_failures(r: int, out: dict[str, str]) -> None:
    """Rank 0 raises its own error, the others CommError naming rank 0 (also under MPI)."""
    assert out["after"] == "ok", out
    mine = {
        "unpicklable": "TypeError: cannot pickle lock",
        "bad_list": "ValueError: object_list must be a list with one slot per rank",
        "broadcast_unpicklable": "TypeError: cannot pickle list",
        "broadcast_not_a_list": "TypeError: object_list must be a list, got str",
        "gather_unpicklable": "TypeError: cannot pickle lock",
        "gather_bad_list": "ValueError: object_gather_list on the destination must be a list",
        "scatter_unpicklable": "TypeError: cannot pickle lock",
        "scatter_not_a_list": "ValueError: scatter_object_input_list on the source must be",
    }
    theirs = {
        "unpicklable": "rank 0 could not pickle its object",
        "bad_list": "rank 0 passed an object_list of the wrong kind or length",
        "broadcast_unpicklable": "rank 0 could not pickle its object",
        "broadcast_not_a_list": "rank 0 passed an object_list of the wrong kind or length",
        "gather_unpicklable": "rank 0 could not pickle its object",
        "gather_bad_list": "rank 0 passed an object_list of the wrong kind or length",
        "scatter_unpicklable": "rank 0 could not pickle its object",
        "scatter_not_a_list": "rank 0 passed an object_list of the wrong kind or length",
    }
    for name in mine:
        if r == 0:
            assert out[name].startswith(mine[name]), (name, out[name])
        else:
            assert out[name].startswith("CommError: ") and theirs[name] in out[name], (name, out)
    if r == 0:
        assert out["scatter_bad_output"] == "no error", out["scatter_bad_output"]
    else:
        assert out["scatter_bad_output"].startswith(
            "ValueError: scatter_object_output_list must be a non-empty list"
        ), out["scatter_bad_output"]
    if r == 0:
        assert out["send_unpicklable"].startswith("TypeError: cannot pickle lock"), out
        assert out["send_then_short_list"] == "no error", out
    elif r == 1:
        assert out["send_unpicklable"].startswith("CommError: recv_object_list: rank 0 could"), out
        assert out["send_then_short_list"].startswith(
            "ValueError: recv_object_list: rank 0 sent 2 objects"
        ), out
        assert out["pair_after"] == "['after']", out
    assert out["gather_no_such_rank"].startswith("ValueError: gather_object: ") and (
        "is not a rank of the group" in out["gather_no_such_rank"]
    ), out["gather_no_such_rank"]


def test_a_rank_refuses_another_ranks_error_feedback(pools: Callable[[int], RankPool]) -> None:
    """Before, rank 1 took rank 0's error feedback without a word, and the run did not
    resume as it was. The loads are collectives: rank 0, whose state is its own, refuses
    too, and nothing is loaded anywhere."""
    res = pools(2).run(hc.another_ranks_state, timeout=120)
    for r, out in enumerate(res):
        for name in ("scheduler_onebit", "onebit_adam", "diloco"):
            if r == 0:
                assert "another rank" in out[name] and "refused its state" in out[name], out
            else:
                assert "saved by rank 0 of its group, and this is rank 1" in out[name], out
                assert not out[name].startswith("changed"), out
        for name in ("scheduler_none", "scheduler_onebit_own", "scheduler_none_own"):
            assert out[name] == "ok", (r, name, out[name])
        assert out["onebit_adam_own"] == "ok" and out["diloco_own"] == "ok", out


def test_an_interrupt_between_claim_and_hand_off_leaves_the_handle_waitable(
    pools: Callable[[int], RankPool],
) -> None:
    check_interrupted_hand_off(pools(2).run(hc.interrupted_hand_off, timeout=90)[0])


def check_interrupted_hand_off(out: dict[str, object]) -> None:
    """Rank 0's side of hardening_cases.interrupted_hand_off."""
    for mode in ("wait", "wait_timeout", "await"):
        assert out[mode] == "KeyboardInterrupt", out
        assert out[f"{mode}_after"] == [3.0, 3.0], out
    assert out["await_all_reduce"] == "KeyboardInterrupt", out
    assert out["await_all_reduce_after"] == [2.0, 2.0], out


@pytest.mark.parametrize("world_size", [2, 3])
def test_split_sizes_of_any_sequence_type(
    pools: Callable[[int], RankPool], world_size: int
) -> None:
    for out in pools(world_size).run(hc.split_size_types, timeout=60):
        check_split_sizes(out)


def check_split_sizes(out: dict[str, str]) -> None:
    """(also under MPI)"""
    for name in ("list", "tuple", "tensor", "numpy", "after"):
        assert out[name] == "ok", (name, out[name])
    assert "must have" in out["negative"] and "none negative" in out["negative"], out
    assert out["numpy_src"].endswith("got int64; pass int(src)"), out


def test_objects_of_an_ended_job_refuse_with_the_fix() -> None:
    from overlap.testing import _free_port

    res = spawn_ranks(hc.objects_of_an_ended_job, 2, _free_port(), timeout=120)
    for r, out in enumerate(res):
        ended = "was built in a job that destroy_process_group() has since ended"
        assert out["backward"].startswith(f"RuntimeError: this BucketScheduler {ended}"), out
        assert "call remove() on it" in out["backward"], out
        assert out["synchronize"].startswith(f"RuntimeError: this BucketScheduler {ended}"), out
        assert out["diloco_step"].startswith(f"RuntimeError: this DiLoCo {ended}"), out
        assert out["global_weights"] is True and out["diloco_resumed"] is True, out
        assert "carrying the state over with state_dict()" in out["diloco_step"], out
        assert out["group"].startswith(
            "ValueError: this process group belongs to a job that destroy_process_group() has ended"
        ), out
        assert out["destroy_group"] == out["remove"] == out["diloco_remove"] == "no error", out
        assert out["fresh_grad"] == [1.5] * 8, (r, out)


@pytest.mark.parametrize("spec", ["gloo", "cpu:gloo", "cpu:gloo,cuda:gloo"])
def test_adopts_a_torch_group_by_its_backend(spec: str) -> None:
    """A device map was adopted under its raw name: "cpu:gloo" ran as a job of no known
    backend, without gloo's dtype refusal (an int16 all_reduce failed inside torch)."""
    from overlap.testing import _free_port

    for r, out in enumerate(spawn_ranks(hc.adopts_a_torch_group, 2, spec, _free_port())):
        assert out["backend"] == "gloo", out
        assert out["sum"] == [3.0] * 3, out
        assert out["received"] == [float(1 - r)] * 2, out
        assert out["int16"].startswith("TypeError: tensor is torch.int16, which gloo"), out


@pytest.mark.parametrize("mode", ["explicit", "inherited"])
def test_an_adopted_job_keeps_its_timeout(mode: str) -> None:
    """The timeout passed when adopting was ignored, and overlap's groups in an adopted job
    got torch's 30-minute default: a late peer hung rank 0 instead of failing in 3 s."""
    from overlap.testing import _free_port

    res = spawn_ranks(hc.adopted_job_timeout, 2, mode, _free_port(), timeout=60)
    kind, seconds, other = res[0]
    assert kind == "CommError", res
    assert seconds < 7.5, res
    assert "init_distributed('mpi'): torch.distributed is already initialised" in other, res


def test_a_torch_group_of_another_backend_is_refused(pools: Callable[[int], RankPool]) -> None:
    for out in pools(2).run(hc.torch_group_of_another_backend, timeout=60):
        assert out["fake"].startswith(
            "group ranks0,1 runs on torch's 'fake' backend but this job's backend is 'gloo'"
        ), out
        assert out["own"] == [3.0, 3.0], out
