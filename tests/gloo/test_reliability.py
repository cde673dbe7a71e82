"""Faults become errors, never hangs; bad collectives are caught; load is held."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from overlap.testing import RankPool
from tests.gloo import reliability_cases as rc

TIMEOUT = 10.0  # the process-group timeout of the fault-injection jobs


def test_debug_mode_names_the_mismatch(pools: Callable[[int], RankPool]) -> None:
    res = pools(2).run(rc.mismatch_is_detected, timeout=60)
    for r in (0, 1):
        assert res[r]["after"] == [2.0, 2.0, 2.0]
        assert res[r]["scheduler"] == res[r]["scheduler_unused"] == "ok"
        for case in ("shape", "op", "dtype", "reduce_op", "root", "reduce_scatter_tensor"):
            ranks, msg = res[r][case]
            assert ranks == [1] and "collective mismatch" in msg, (r, case, msg)
        assert "float32[4]" in res[r]["shape"][1] and "float32[8]" in res[r]["shape"][1]
        assert "broadcast" in res[r]["op"][1]
        assert "op=sum" in res[r]["reduce_op"][1] and "op=max" in res[r]["reduce_op"][1]
        assert "src=0" in res[r]["root"][1] and "src=1" in res[r]["root"][1]
        ranks, msg = res[r]["splits"]
        assert ranks == [0, 1], (r, msg)
        assert "rank 0 sends 4 float32 elements to rank 1, which expects 2 float32" in msg, msg
        assert res[r]["uneven"] is True
        ranks, msg = res[r]["list_dtype"]
        assert ranks == [0, 1], (r, msg)
        assert "rank 0 sends 2 float32 elements to rank 1, which expects 1 float64" in msg, msg
        assert res[r]["uneven_list"] is True


def test_debug_mode_names_a_write_to_a_tensor_in_flight(
    pools: Callable[[int], RankPool],
) -> None:
    rc.check_in_flight_writes(pools(2).run(rc.in_flight_writes_are_named, timeout=60))


def test_debug_mode_catches_a_message_that_does_not_fit(
    pools: Callable[[int], RankPool],
) -> None:
    """gloo fills a larger receive partly with no error and aborts the process on a smaller
    one; debug mode's headers turn both, and a dtype mismatch, into MessageMismatchError on
    the receiving rank, leave its tensor unchanged and keep the pair in step."""
    check_message_mismatch(pools(2).run(rc.message_mismatch_is_detected, timeout=60)[1])


def check_message_mismatch(out: dict[str, Any], smaller_is_truncated: bool = False) -> None:
    """Rank 1's side of reliability_cases.message_mismatch_is_detected in debug mode (also
    under MPI, where MPI's own truncation error meets a message larger than the receive)."""
    cases = [("bigger", "float32[3]", "float32[5]"), ("dtype", "float32[4]", "int32[4]")]
    if smaller_is_truncated:
        kind, _, msg, after = out["smaller"]
        assert kind == "CommError" and "truncated" in msg, out["smaller"]
        assert all(v == -1 for v in after), out["smaller"]
    else:
        cases.append(("smaller", "float32[8]", "float32[4]"))
    for case, sent, into in cases:
        kind, ranks, msg, after = out[case]
        assert kind == "MessageMismatchError" and ranks == [0, 1], out[case]
        assert f"got a {sent} message" in msg and f"for a {into} tensor" in msg, msg
        assert all(v == -1 for v in after), out[case]  # the receiving tensor is unchanged
    assert out["reshaped"] == ("ok", 0, [1.0, 2.0, 3.0, 4.0]), out
    assert out["after"] == ("ok", 0, [1.0, 2.0, 3.0, 4.0]), out
    assert out["in_flight"] == [[2.0, 2.0], [3.0, 3.0, 3.0]], out


def test_10000_concurrent_awaited_ops(pools: Callable[[int], RankPool]) -> None:
    assert pools(2).run(rc.many_ops, 10_000, timeout=300) == [10_000, 10_000]


def test_2000_steps_keep_rss_flat_and_threads_constant(pools: Callable[[int], RankPool]) -> None:
    for r in pools(2).run(rc.long_training_is_flat, 2000, timeout=600):
        assert r["rss_growth"] < 0.05, r
        assert r["threads_after"] == r["threads_before"], r
        assert r["waiters_outstanding"] == 0, r


@pytest.mark.parametrize("where", ["collective", "compressed", "bucket"])
def test_sigkilled_peer_becomes_comm_error(where: str) -> None:
    pool = RankPool(2, timeout=TIMEOUT)
    pool.start()
    try:
        res = pool.run(rc.peer_killed, where, timeout=120, expect_dead=(1,))
    finally:
        codes = pool.close()
    kind, seconds, *cause = res[0]
    assert kind == "CommError", res
    assert seconds < TIMEOUT + 5, res
    assert cause and cause[0] not in ("NoneType", "")  # the backend's error is kept
    assert codes[0] == 0, codes  # the survivor then exited by itself, nothing stuck


def _two_ranks(script: str, args: list[str], timeout: float) -> tuple[Any, float]:
    """Run ``script`` as rank 1 (in the background) and rank 0; rank 0's result and how long
    it took."""
    import os
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    path = Path(__file__).with_name(script)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    peer = subprocess.Popen(
        [sys.executable, str(path), *args],
        env={**env, "RANK": "1", "LOCAL_RANK": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    t0 = time.monotonic()
    try:
        out = subprocess.run(
            [sys.executable, str(path), *args],
            env={**env, "RANK": "0", "LOCAL_RANK": "0"},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    finally:
        peer.kill()
        peer.wait()
    return out, time.monotonic() - t0


def test_exit_with_a_collective_in_flight_waits_for_it_and_exits_cleanly() -> None:
    """An awaited op still in flight at exit fails while the interpreter would be finalizing:
    exit waits for its observation to end instead of aborting (overlap/comm/quiesce.py)."""
    out, seconds = _two_ranks("pending_at_exit_script.py", ["4"], timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "rank 0 timed out waiting" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "terminate called" not in out.stderr, out.stderr[-2000:]
    assert "exit waits for 1 op(s) still in flight" in out.stderr, out.stderr[-2000:]
    assert "all_reduce" in out.stderr, out.stderr[-2000:]  # the warning names the op
    assert seconds < 20, seconds  # it ended when the peer left, not at the job timeout


def test_exit_right_after_a_failed_blocking_collective_is_clean() -> None:
    """A blocking collective that failed by the job timeout (the peer alive, never joining),
    caught, then an exit at once: exit 0, no abort (the job is destroyed at exit)."""
    for _ in range(2):
        out, seconds = _two_ranks("failed_at_exit_script.py", ["10"], timeout=60)
        assert "rank 0 CommError" in out.stdout, out.stdout + out.stderr[-2000:]
        assert out.returncode == 0, out.stderr[-2000:]
        assert "terminate called" not in out.stderr, out.stderr[-2000:]
        assert seconds < 8.0, seconds  # it did not wait for the peer to leave (at 10 s)


def test_a_program_that_ends_with_a_step_in_flight_exits_quietly() -> None:
    """The program ends with a scheduler's step still queued: exit 0 with nothing logged
    (the job's teardown at exit is what the queued bucket meets)."""
    out, _ = _two_ranks("queued_at_exit_script.py", ["10"], timeout=60)
    assert "rank 0 ends with a step in flight" in out.stdout, out.stdout + out.stderr[-2000:]
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stderr.strip() == "", out.stderr[-2000:]


def test_survivor_of_a_peer_death_exits_cleanly_every_time() -> None:
    """Item 8: 4 runs; the survivor gets CommError and exits 0, with no abort at exit."""
    for _ in range(4):
        out, _ = _two_ranks("survivor_script.py", [], timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        assert "rank 0 CommError" in out.stdout, out.stdout + out.stderr[-2000:]
        assert "terminate called" not in out.stderr, out.stderr[-2000:]
