"""overlap.comm.rendezvous: the mistakes of a job started by hand are told at once and in
words (a host that does not resolve, an interface the host lacks, torch's rendezvous
failures), and a rank that waits says what it waits for."""

from __future__ import annotations

import logging
import socket
import time

import pytest

from overlap.comm import rendezvous as rv
from overlap.comm.handshake import Progress
from overlap.errors import CommError, CommTimeoutError


def test_a_host_that_does_not_resolve_is_refused_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: torch retried for its whole timeout (11 s with timeout=8), then said only
    that it could not connect, above a C++ stack."""
    import overlap.comm as comm

    monkeypatch.setenv("MASTER_ADDR", "nosuchhost.invalid")
    monkeypatch.setenv("MASTER_PORT", "29599")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="'nosuchhost.invalid' of nosuchhost.invalid:29599 "
                       r"\(MASTER_ADDR:MASTER_PORT\) does not resolve"):  # fmt: skip
        comm.init_distributed("gloo", timeout=30)
    assert time.monotonic() - t0 < 5.0
    assert not comm.is_initialized()


def test_an_interface_the_host_lacks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: gloo's "[enforce fail at .../device.cc:84] ifa != nullptr. Unable to find
    address for: eth9", which names neither the variable nor the host's interfaces."""
    import overlap.comm as comm

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo,eth9")
    have = ", ".join(sorted(n for _, n in socket.if_nameindex()))
    with pytest.raises(ValueError, match=f"no interface eth9 \\(it has {have}\\)"):
        comm.init_distributed("gloo", rank=0, world_size=1)
    assert not comm.is_initialized()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    rv.check_ifname("gloo")  # one it has: nothing to say
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")
    rv.check_ifname("nccl")  # gloo's variable: not NCCL's business


@pytest.mark.parametrize(
    "torch_says, kind, words",
    [
        ("Timed out after 9 seconds waiting for clients. 2/4 clients joined.", CommTimeoutError,
         "rank 0 waited 8 s at H for the other 3 rank(s) to connect, and 1 did"),
        ("The client socket has timed out after 8000ms while trying to connect to (h, 1).",
         CommTimeoutError, "rank 1 could not reach rank 0 at H within 8 s: rank 0 has not "
         "started"),
        ("The server socket has failed to listen on any local network address. port: 1, "
         "code: -98, name: EADDRINUSE, message: address already in use", CommError,
         "the port is in use on its host (another job, an earlier run still ending, or a "
         "second process started as rank 0). Choose another MASTER_PORT"),
    ],
    ids=["rank-0-alone", "no-rank-0", "port-taken"],
)  # fmt: skip
def test_torchs_rendezvous_failures_are_said_with_the_fix(
    torch_says: str, kind: type, words: str
) -> None:
    got = rv._translated(RuntimeError(torch_says), "H", 1, 4, 8.0)
    assert type(got) is kind
    assert words in str(got)
    assert rv._translated(RuntimeError("something else"), "H", 1, 4, 8.0) is None


def test_a_long_wait_is_logged_with_what_it_waits_for(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A rank whose peers never come said nothing for the whole timeout (30 minutes by
    default); now it says what it waits for after 30 s, 2 and 5 minutes, then every 10."""
    monkeypatch.setattr(rv, "WARN_AFTER_S", (0.3,))
    monkeypatch.setattr(rv, "WARN_EVERY_S", 1.0)
    progress = Progress("to reach rank 0 at H")
    with caplog.at_level(logging.WARNING, logger="overlap.comm.rendezvous"):
        with rv.logged_wait(3, progress, 1800.0):
            time.sleep(0.6)  # said at 0.3 s
            progress.text = "at the handshake: 2 of 4 ranks have joined"
            time.sleep(1.0)  # said at 1.3 s
        time.sleep(1.0)  # nothing after the block (the next would come at 2.3 s)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "init_distributed: rank 3 has waited 0 s to reach rank 0 at H; it gives up after "
        "1800 s (timeout=)",
        "init_distributed: rank 3 has waited 1 s at the handshake: 2 of 4 ranks have joined; "
        "it gives up after 1800 s (timeout=)",
    ]


def test_overlap_env_says_what_init_would_meet() -> None:
    """``overlap env`` on a host of a job that will not start: the launcher's variables, the
    rendezvous (does it resolve, which interface reaches it) and GLOO_SOCKET_IFNAME."""
    have = ", ".join(sorted(n for _, n in socket.if_nameindex()))
    got = rv.report(
        {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
         "GLOO_SOCKET_IFNAME": "lo,eth9"}
    )  # fmt: skip
    assert got == [
        "launch: RANK=1 WORLD_SIZE=2",
        "rendezvous: 127.0.0.1:29500 (MASTER_ADDR:MASTER_PORT): 127.0.0.1, reached through lo",
        f"GLOO_SOCKET_IFNAME: lo,eth9: this host has no eth9 (it has {have})",
    ]
    got = rv.report({"MASTER_ADDR": "nosuchhost.invalid", "MASTER_PORT": "1"})
    assert got[0] == "launch: no RANK/WORLD_SIZE here"
    assert got[1].startswith("rendezvous: nosuchhost.invalid:1 (MASTER_ADDR:MASTER_PORT): "
                             "'nosuchhost.invalid' does not resolve")  # fmt: skip
    assert got[2].startswith("GLOO_SOCKET_IFNAME: unset")
