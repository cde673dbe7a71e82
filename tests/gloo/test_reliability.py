"""Faults become errors, never hangs; bad collectives are caught; load is held."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from overlap.testing import RankPool
from tests.gloo import reliability_cases as rc

TIMEOUT = 10.0  # the process-group timeout of the fault-injection jobs


def test_debug_mode_names_the_mismatch(pools: Callable[[int], RankPool]) -> None:
    res = pools(2).run(rc.mismatch_is_detected, timeout=60)
    for r in (0, 1):
        assert res[r]["after"] == [2.0, 2.0, 2.0]
        assert res[r]["scheduler"] == "ok"
        for case in ("shape", "op", "dtype", "reduce_op", "root"):
            ranks, msg = res[r][case]
            assert ranks == [1] and "collective mismatch" in msg, (r, case, msg)
        assert "float32[4]" in res[r]["shape"][1] and "float32[8]" in res[r]["shape"][1]
        assert "broadcast" in res[r]["op"][1]
        assert "op=sum" in res[r]["reduce_op"][1] and "op=max" in res[r]["reduce_op"][1]
        assert "src=0" in res[r]["root"][1] and "src=1" in res[r]["root"][1]


def test_10000_concurrent_awaited_ops(pools: Callable[[int], RankPool]) -> None:
    assert pools(2).run(rc.many_ops, 10_000, timeout=300) == [10_000, 10_000]


def test_2000_steps_keep_rss_flat_and_threads_constant(pools: Callable[[int], RankPool]) -> None:
    for r in pools(2).run(rc.long_training_is_flat, 2000, timeout=600):
        assert r["rss_growth"] < 0.05, r
        assert r["threads_after"] == r["threads_before"], r


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


def test_survivor_of_a_peer_death_exits_cleanly_every_time() -> None:
    """Item 8: 4 runs; the survivor gets CommError and exits 0, with no abort at exit."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("survivor_script.py")
    for _ in range(4):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env["WORLD_SIZE"] = "2"
        peer = subprocess.Popen(
            [sys.executable, str(script)],
            env={**env, "RANK": "1", "LOCAL_RANK": "1"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            out = subprocess.run(
                [sys.executable, str(script)],
                env={**env, "RANK": "0", "LOCAL_RANK": "0"},
                capture_output=True,
                text=True,
                timeout=60,
            )
        finally:
            peer.kill()
            peer.wait()
        assert out.returncode == 0, out.stderr[-2000:]
        assert "rank 0 CommError" in out.stdout, out.stdout + out.stderr[-2000:]
        assert "terminate called" not in out.stderr, out.stderr[-2000:]
