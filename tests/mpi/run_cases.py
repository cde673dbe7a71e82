"""Run under mpiexec: the backend-agnostic op cases and contracts, every mode.

Prints one line per rank, ``RESULT {json}``: {case: "ok" | traceback}. Usage:
    mpiexec -n N python -m tests.mpi.run_cases [backend]
"""

from __future__ import annotations

import faulthandler
import json
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import overlap
from overlap import comm
from overlap.errors import CommError
from tests.gloo import bad_input_cases, cases
from tests.gloo import contract_cases as cc
from tests.gloo import differential_cases as dfc
from tests.gloo import diloco_cases as dl
from tests.gloo import ds_comm_cases as ds
from tests.gloo import hardening_cases as hc
from tests.gloo import onebit_adam_cases as oc
from tests.gloo import reliability_cases as rc
from tests.gloo import scheduler_cases as sc
from tests.gloo import state_broadcast_cases as sb
from tests.gloo import topology_cases as tc
from tests.mpi import mpi_cases

MODES = ["blocking", "wait", "uvloop", "asyncio"]
JOB_TIMEOUT_S = 60
WATCHDOG_S = 45


def checks() -> dict[str, Callable[[], Any]]:
    out: dict[str, Callable[[], Any]] = {}
    for name in sorted(cases.CASES):
        for mode in MODES:
            out[f"{name}/{mode}"] = lambda name=name, mode=mode: cases.run_case(name, mode)
    for loop in ("uvloop", "asyncio"):
        out[f"many_in_flight/{loop}"] = lambda loop=loop: cc.many_in_flight(1000, loop)
    if comm.get_world_size() == 2:
        out["cancelled_awaiter"] = lambda: cc.cancelled_awaiter("uvloop")
        out["timeout_at_awaiting_side"] = cc.timeout_at_awaiting_side
        out["handle_keeps_tensors"] = cc.handle_keeps_tensors
        out["dropped_handle_still_completes"] = cc.dropped_handle_still_completes
        # 4,000 in flight, the last awaited first (it waits behind 3,999 ops nobody awaits
        # yet): correct, and past the point where the engine's back-off once made it 10x
        # slower (their speed: overlap bench ops --backend mpi --concurrent 4000,10000)
        out["many_in_flight/4000"] = lambda: cc.many_in_flight(4000, "uvloop")
    out.update(mpi_cases.CHECKS)
    out["multiphase_without_waiter"] = hc.multiphase_progress_without_waiter
    out["debug_mode"] = _debug_mode
    out["message_mismatch"] = _message_mismatch
    out["message_mismatch/debug_mode"] = _message_mismatch_in_debug_mode
    out["aliased_buffers"] = _aliased_buffers
    out["object_failures"] = _object_failures
    out["split_size_types"] = _split_size_types
    out["interrupted_wait"] = _interrupted_wait
    out["onebit_adam/standalone"] = oc.standalone_matches_reference
    out["onebit_adam/overlapped"] = oc.overlapped_matches_reference
    out["diloco/plain"] = lambda: dl.matches_reference([1, 4], steps=9)
    out["diloco/streaming"] = lambda: dl.matches_reference([4], 2, 1, "async", steps=10)
    # the pseudo-gradient on the pass thread, each pass held up 10 ms: the MPI job waits
    out["diloco/pass_thread"] = lambda: dl.matches_reference(
        [4], 2, 1, "blocking", 10, 0.5, None, "fused", False, False, 0.01
    )
    out["diloco/resume_int8"] = lambda: _true(dl.resume_is_bit_identical("int8"))
    out["diloco/finish"] = lambda: _true(
        dl.finish_ends_on_one_model(4, 2, 1, 10, 0.5) == [[0, 1], True, True, 0]
    )
    out["diloco/afinish"] = lambda: _true(
        dl.finish_ends_on_one_model(4, 2, 1, 10, 0.0, mode="async") == [[1], True, True, 0]
    )
    out["int8_reduce"] = lambda: _int8_bounded(dl.quantized_reduce("int8", 1000, 64))
    out["differential"] = _differential
    if comm.get_world_size() == 2:
        out["diloco/late_landings"] = _late_landings
        out["in_flight_writes"] = _in_flight_writes
        out["raising_callbacks"] = _raising_callbacks
        out["loops_are_freed"] = _loops_are_freed
    out.update({f"ds_comm/{k}": v for k, v in ds.CHECKS.items()})
    out.update({f"state_broadcast/{k}": v for k, v in sb.CHECKS.items()})
    if comm.get_world_size() == 3:  # groups [0, 1] and [2]
        out["schedulers_per_subgroup"] = lambda: _disagree(sc.schedulers_per_subgroup())
    if comm.get_world_size() == 4:  # the sub-group checks that need 2 x 2 ranks
        out.update(FOUR_RANKS)
    return out


def _differential() -> None:
    """Random ops against a reference each rank computes (tests/gloo/differential_cases.py)."""
    bad = dfc.run(3, 200)
    assert not bad, bad[:5]


def _in_flight_writes() -> None:
    """Debug mode names a write to an async op's tensor while the op is in flight
    (tests/gloo/reliability_cases.py; every op is checked on MPI)."""
    both: list[Any] = [None, None]
    comm.all_gather_object(both, rc.in_flight_writes_are_named())
    rc.check_in_flight_writes(both)


def _raising_callbacks() -> None:
    """A done-callback that raises harms no other callback and no later op (on MPI: the
    progress engine that runs it goes on)."""
    both: list[Any] = [None, None]
    comm.all_gather_object(both, cc.a_raising_callback_harms_nothing())
    cc.check_raising_callbacks(both)


def _loops_are_freed() -> None:
    """Event loops that polled MPI ops on their progress engine are freed."""
    kept = cc.loops_are_freed(30)
    assert kept == (0, 0), f"(loops, anon-inode fds) kept: {kept}"


def _disagree(out: dict[str, str]) -> None:
    assert out["disagree"].startswith(
        "ValueError: BucketScheduler: the ranks disagree on their groups: ranks [0, 1, 2] "
        "are one group for some of them, but rank 0 gave ranks [0, 1]"
    ), out
    assert out["outside"].startswith(
        "ValueError: BucketScheduler: rank 2 was given the group of ranks [0, 1], which it is "
        "not a member of"
    ), out


def _schedulers_2x2() -> None:
    out = sc.schedulers_per_subgroup("onebit")
    assert out["disagree"].startswith("ValueError: BucketScheduler: the ranks disagree"), out
    assert out["outside"].startswith("ValueError: BucketScheduler: rank 2 was given"), out


def _workers_2x2() -> None:
    out = dl.workers_of_several_ranks()
    assert out["syncs"] == 2 and out["same_ranks"].startswith("ValueError: this model's"), out
    assert out["finished_buffers"] == [[1.5] * 3, 10], out


def _grid_2x2() -> None:
    r = comm.get_rank()
    got = tc.grid_groups_take_every_op()
    assert got[0] == (1.0 if r < 2 else 5.0) and got[1] == (1.5 if r < 2 else 3.5), got
    assert got[3], got


# 4 ranks: a scheduler per data-parallel group, hierarchical DiLoCo, a grid's groups under
# every op (run alone: `mpiexec -n 4 python -m tests.mpi.run_cases mpi --only four`)
FOUR_RANKS: dict[str, Callable[[], Any]] = {
    "schedulers_per_subgroup/2x2": _schedulers_2x2,
    "workers_of_several_ranks": _workers_2x2,
    "grid_groups_take_every_op": _grid_2x2,
}


def _true(ok: bool) -> None:
    assert ok


def _late_landings() -> None:
    """Rank 1 60 ms behind every step: rank 0's landings wait, and it says so once."""
    said = dl.late_landings_said(1, "blocking")
    assert len(said) == (1 if comm.get_rank() == 0 else 0), said
    assert not said or "fragment reductions arrive late" in said[0], said


def _int8_bounded(res: list[float]) -> None:
    worst, drift = res
    assert worst < 0.02 and drift < 0.06, res


def _debug_mode() -> None:
    """Debug mode on MPI: a correct scheduler loop and a correct uneven all_to_all_single
    pass; wrong shapes, ops, dtypes, reduce ops, roots and all-to-all splits are flagged on
    every rank, and the group stays in step."""
    out = rc.mismatch_is_detected()
    w = comm.get_world_size()
    assert out["after"] == [float(w)] * 3 and out["scheduler"] == "ok", out
    for case in ("shape", "op", "dtype", "reduce_op", "root"):
        ranks, msg = out[case]
        assert ranks and "collective mismatch" in msg, (case, out[case])
    ranks, msg = out["splits"]
    assert ranks == [0, 1], msg
    assert "rank 0 sends 4 float32 elements to rank 1, which expects 2 float32" in msg, msg
    assert out["uneven"] is True and out["uneven_list"] is True, out
    ranks, msg = out["list_dtype"]
    assert ranks == [0, 1], msg
    assert "rank 0 sends 2 float32 elements to rank 1, which expects 1 float64" in msg, msg


def _message_mismatch() -> None:
    """MPI reports a received message's size: a receive larger than the message raises
    MessageMismatchError (MPI wrote the message's bytes, the rest is unchanged), a smaller
    one CommError (MPI's truncation). Outside debug mode a dtype mismatch of one size is
    not seen (MPI moves bytes)."""
    out = rc.message_mismatch_is_detected(in_debug_mode=False)
    if comm.get_rank() != 1:
        return
    kind, ranks, msg, after = out["bigger"]
    assert kind == "MessageMismatchError" and ranks == [0, 1], out["bigger"]
    assert "received 12 bytes from rank 0 into a 20-byte tensor (float32[5])" in msg, msg
    assert after == [1.0, 2.0, 3.0, -1.0, -1.0], after
    kind, _, msg, _ = out["smaller"]
    assert kind == "CommError" and "truncated" in msg, out["smaller"]
    assert out["dtype"][0] == "ok", out["dtype"]
    assert out["reshaped"] == ("ok", 0, [1.0, 2.0, 3.0, 4.0]), out
    assert out["after"] == ("ok", 0, [1.0, 2.0, 3.0, 4.0]), out
    assert out["in_flight"] == [[2.0, 2.0], [3.0, 3.0, 3.0]], out


def _message_mismatch_in_debug_mode() -> None:
    """In debug mode each message carries a header (overlap.comm.p2p_debug.frame): a dtype
    or size mismatch is MessageMismatchError naming both, the tensor unchanged, as on gloo;
    a message larger than the receive is MPI's truncation error, the tensor unchanged."""
    from tests.gloo.test_reliability import check_message_mismatch

    out = rc.message_mismatch_is_detected()
    if comm.get_rank() == 1:
        check_message_mismatch(out, smaller_is_truncated=True)


def _aliased_buffers() -> None:
    res = hc.aliased_buffers()
    assert res and all(res.values()), res


def _object_failures() -> None:
    from tests.gloo.test_hardening import check_object_failures

    check_object_failures(comm.get_rank(), hc.object_collectives_fail_on_every_rank())


def _split_size_types() -> None:
    from tests.gloo.test_hardening import check_split_sizes

    check_split_sizes(hc.split_size_types())


def _interrupted_wait() -> None:
    from tests.gloo import scheduler_cases as sc
    from tests.gloo.test_scheduler import check_interrupted_wait

    out = sc.interrupted_wait()
    if comm.get_rank() == 0:
        check_interrupted_wait(out)


def main() -> None:
    backend = sys.argv[1] if len(sys.argv) > 1 else "mpi"
    overlap.init_distributed(dist_backend=backend, timeout=JOB_TIMEOUT_S)
    results: dict[str, Any] = {
        "rank": comm.get_rank(),
        "world": comm.get_world_size(),
        "backend": comm.get_backend(),
    }
    threads_before = threading.active_count()
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
    todo = FOUR_RANKS if only == "four" else checks()
    for name, fn in todo.items():
        # A case stuck past WATCHDOG_S prints every thread's stack (the case's frames
        # name it) before a peer's barrier reaches the job timeout and mpiexec kills all.
        faulthandler.dump_traceback_later(WATCHDOG_S)
        try:
            fn()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()[-3000:]
        try:
            comm.barrier()
        except CommError as exc:
            raise RuntimeError(f"rank {comm.get_rank()}: the barrier after {name} failed") from exc
        finally:
            faulthandler.cancel_dump_traceback_later()
    results["threads_before"] = threads_before
    results["threads_after"] = threading.active_count()
    if comm.get_world_size() == 3 and only is None:
        results["bad_input"] = bad_input_cases.bad_calls()
    sys.stdout.write("RESULT " + json.dumps(results) + "\n")
    sys.stdout.flush()
    comm.destroy_process_group()


if __name__ == "__main__":
    main()
