"""overlap.comm.handshake on a real TCPStore, its ranks as threads of this process (each with
a client of its own, as each process has): a job agrees; a rank with another world size,
debug mode or backend, a rank number given twice, a rank outside the world and ranks that
never come are each told on every rank, in words, at once (or at the timeout, naming the
missing ranks)."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
from torch.distributed import TCPStore

from overlap.comm import handshake as hs
from overlap.comm.init import _free_port
from overlap.errors import CommTimeoutError


def _record(rank: int, world: int, **over: Any) -> dict[str, Any]:
    return {**hs.record(rank, world, "gloo", False), "pid": 1000 + rank, **over}


def _meet(records: list[dict[str, Any]], timeout_s: float = 10.0) -> list[BaseException | None]:
    """Each record's handshake on one store, one thread each; what each raised (None: ok)."""
    port = _free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    out: list[BaseException | None] = [None] * len(records)
    round_ = 1

    def one(i: int) -> None:
        client = TCPStore("127.0.0.1", port, is_master=False)
        try:
            hs.handshake(client, records[i], timeout_s, round_=round_)
        except BaseException as exc:
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(records))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 20)
        assert not t.is_alive()
    del server
    return out


def test_a_job_that_agrees_meets() -> None:
    assert _meet([_record(r, 3) for r in range(3)]) == [None, None, None]


@pytest.mark.parametrize(
    "over, words",
    [
        ({"world_size": 3}, "WORLD_SIZE 3 where rank 0 has 2"),
        ({"debug": True},
         "debug mode (OVERLAP_DEBUG or init_distributed(debug=)) True where rank 0 has False"),
        ({"backend": "nccl"}, "backend 'nccl' where rank 0 has 'gloo'"),
    ],
    ids=["world_size", "debug", "backend"],
)  # fmt: skip
def test_a_rank_unlike_rank_0_is_named_on_every_rank(over: dict[str, Any], words: str) -> None:
    """Two processes that make no job (rank 1 unlike rank 0) both raise at once, naming
    rank 1, its process and what differs; before, they met the job timeout in their first
    collective (or in the rendezvous) with errors that named none of it."""
    got = _meet([_record(0, 2), _record(1, 2, **over)])
    for exc in got:
        assert isinstance(exc, ValueError), got
        assert f"rank 1 (pid 1001 on {_record(1, 2)['host']}): {words}" in str(exc)
        assert "each rank number once" in str(exc)


def test_a_rank_number_given_twice_is_told_on_every_rank() -> None:
    """Ranks 0, 1, 1 of 3 (a copy-paste in a launch script): every process raises at once,
    naming the second process of rank 1 and the first; before, all three waited out the
    timeout for a store key named ``/default_pg/0//cpu//0/2``."""
    got = _meet([_record(0, 3), _record(1, 3), _record(1, 3, pid=2001)])
    assert all(isinstance(e, ValueError) for e in got), got
    assert all("a second process was started as rank 1 (the first: pid" in str(e) for e in got)


def test_a_process_outside_rank_0s_world_is_refused() -> None:
    """A third process told RANK=2 beside a job of two: it is refused, naming itself. The job
    of ranks 0 and 1 is whole without it: it goes on, or refuses too when the stray process
    said so before the two had agreed (the order the three reach the store decides)."""
    got = _meet([_record(0, 2), _record(1, 2), _record(2, 3, world_size=2)])
    assert isinstance(got[2], ValueError), got
    assert "rank 2 is outside rank 0's WORLD_SIZE 2" in str(got[2])
    for exc in got[:2]:
        assert exc is None or "rank 2 is outside rank 0's WORLD_SIZE 2" in str(exc), got


def test_ranks_that_never_come_are_named_at_the_timeout() -> None:
    got = _meet([_record(0, 4), _record(2, 4)], timeout_s=1.5)
    for exc in got:
        assert isinstance(exc, CommTimeoutError), got
        assert "rank(s) 1, 3 of 4 never came" in str(exc)
        assert "waited 1.5 s at the handshake" in str(exc)


def test_another_torch_version_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="overlap.comm.handshake"):
        got = _meet([_record(0, 2), _record(1, 2, torch="2.2.2")])
    assert got == [None, None]
    assert "rank 1 runs another torch version" in caplog.text
    assert "2.2.2 here" in caplog.text


def test_a_lost_store_is_not_waited_out() -> None:
    """A store that fails (its rank 0 gone) fails the wait at once, not after the timeout
    in a loop of failing slices."""
    import time

    port = _free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    client = TCPStore("127.0.0.1", port, is_master=False)
    del server  # rank 0's store goes away
    t0 = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 (torch's own: the connection is gone)
        hs.handshake(client, _record(1, 2), 30.0, round_=1)
    assert time.monotonic() - t0 < 10.0
