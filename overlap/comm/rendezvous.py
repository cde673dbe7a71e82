"""init_distributed's meeting of the ranks on torch's backends: torch's own rendezvous (the
store every rank joins), then overlap's :mod:`~overlap.comm.handshake` on it, with the
mistakes a person starting ranks by hand makes told at once, in words, on every rank.

Why (fifty-eighth session, each tried by hand with two processes on this host):

- ``MASTER_ADDR`` that does not resolve: 11 s of retries, then torch's "The client socket
  has timed out after 8000ms while trying to connect to (nosuchhost.invalid, 29559)"
  above a 40-frame C++ stack. Now a ValueError at once, naming the variable.
- ``GLOO_SOCKET_IFNAME`` naming no interface: gloo's "[enforce fail at .../device.cc:84]
  ifa != nullptr. Unable to find address for: eth9". Now a ValueError naming the
  interfaces the host has.
- A rank that waits for the others said nothing for the whole timeout (30 minutes by
  default). Now it logs, after 30 s, 2 and 5 minutes and then every 10, what it waits for
  (:func:`logged_wait`).
- torch's failures of the rendezvous itself (rank 0 alone: "Timed out after 9 seconds
  waiting for clients. 1/2 clients joined."; rank 1 alone; the port taken: "EADDRINUSE")
  named neither the variables nor the fix. They are raised as CommTimeoutError or
  CommError saying both, the original chained.

The process group is then made on the same store (``init_process_group(store=...)``), as
torch's own ``init_method`` path does after its rendezvous (``set_timeout``, then a
``PrefixStore("default_pg")``; torch 2.2 to 2.14 alike).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import re
import socket
import threading
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlparse

from torch.distributed.rendezvous import rendezvous

from overlap.comm.handshake import Progress, handshake, record
from overlap.errors import CommError, CommTimeoutError

__all__ = [
    "WARN_AFTER_S",
    "check_address",
    "check_ifname",
    "join",
    "logged_wait",
    "report",
    "where",
]

log = logging.getLogger(__name__)

# when a wait at init is logged: these, then every WARN_EVERY_S
WARN_AFTER_S: tuple[float, ...] = (30.0, 120.0, 300.0)
WARN_EVERY_S = 600.0


def where(init_method: str) -> tuple[str | None, str]:
    """(the host to check, the rendezvous in words) of ``init_method``."""
    if init_method == "env://":
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        return host, f"{host}:{port} (MASTER_ADDR:MASTER_PORT)"
    url = urlparse(init_method)
    if url.scheme == "tcp":
        return url.hostname, f"{url.hostname}:{url.port} ({init_method})"
    return None, init_method


def check_address(host: str | None, said: str) -> None:
    """ValueError at once when ``host`` does not resolve: torch retried for its whole
    timeout and then said only that it could not connect."""
    if not host:
        return
    try:
        socket.getaddrinfo(host, None)
    except socket.gaierror as exc:
        raise ValueError(
            f"init_distributed: the rendezvous host {host!r} of {said} does not resolve "
            f"({exc.strerror}): set MASTER_ADDR (or init_method) to rank 0's host name or "
            "address, the same on every rank"
        ) from None


def _interfaces_lacking(raw: str) -> tuple[list[str], list[str]]:
    """(the names in GLOO_SOCKET_IFNAME's value ``raw`` this host lacks, those it has)."""
    have = sorted(name for _, name in socket.if_nameindex())
    return [n for n in (x.strip() for x in raw.split(",")) if n and n not in have], have


def check_ifname(backend: str) -> None:
    """ValueError when GLOO_SOCKET_IFNAME names an interface this host does not have
    (gloo's own error: "[enforce fail ...] ifa != nullptr. Unable to find address for")."""
    raw = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if backend != "gloo" or not raw.strip():
        return
    with contextlib.suppress(OSError):
        missing, have = _interfaces_lacking(raw)
        if missing:
            raise ValueError(
                f"GLOO_SOCKET_IFNAME={raw!r}: this host has no interface {', '.join(missing)} "
                f"(it has {', '.join(have)}): set it to the one that reaches the other hosts, "
                "or unset it (overlap then picks the one that reaches MASTER_ADDR)"
            )


def report(env: Mapping[str, str] | None = None) -> list[str]:
    """What ``init_distributed`` would meet here, in lines (``overlap env`` prints them, run
    on each host of a job that will not start): the launcher's variables, the rendezvous
    and whether its host resolves, the interface that reaches it, GLOO_SOCKET_IFNAME."""
    from overlap.comm.netif import interface_for

    env = os.environ if env is None else env
    said = [f"{k}={env[k]}" for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k in env]
    out = [f"launch: {' '.join(said)}" if said else "launch: no RANK/WORLD_SIZE here"]
    host, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if host:
        try:
            found = socket.getaddrinfo(host, None)
            ipv4 = [a for a in found if a[0] == socket.AF_INET]  # gloo's, as netif.py's
            addr = (ipv4 or found)[0][4][0]
        except socket.gaierror as exc:
            out.append(f"rendezvous: {host}:{port} (MASTER_ADDR:MASTER_PORT): {host!r} does "
                       f"not resolve ({exc.strerror})")  # fmt: skip
        else:
            via = interface_for(str(addr))
            reach = f", reached through {via}" if via else ", no interface found that reaches it"
            out.append(f"rendezvous: {host}:{port} (MASTER_ADDR:MASTER_PORT): {addr}{reach}")
    raw = env.get("GLOO_SOCKET_IFNAME", "")
    if not raw.strip():
        out.append("GLOO_SOCKET_IFNAME: unset (init_distributed picks the interface that "
                   "reaches MASTER_ADDR)")  # fmt: skip
    else:
        missing, have = _interfaces_lacking(raw)
        lacks = f": this host has no {', '.join(missing)} (it has {', '.join(have)})"
        out.append(f"GLOO_SOCKET_IFNAME: {raw}{lacks if missing else ''}")
    return out


@contextlib.contextmanager
def logged_wait(rank: int, progress: Progress, timeout_s: float) -> Iterator[None]:
    """While the block runs, log at WARNING what rank ``rank`` waits for
    (``progress.text``) after :data:`WARN_AFTER_S` seconds, then every
    :data:`WARN_EVERY_S`: a rank whose peers never come otherwise says nothing until its
    timeout (30 minutes by default)."""
    over = threading.Event()

    def watch() -> None:
        waited = 0.0
        marks = iter(WARN_AFTER_S)
        while True:
            mark = next(marks, waited + WARN_EVERY_S)
            if over.wait(mark - waited):
                return
            waited = mark
            log.warning(
                "init_distributed: rank %d has waited %.0f s %s; it gives up after %.0f s "
                "(timeout=)",
                rank,
                waited,
                progress.text,
                timeout_s,
            )

    thread = threading.Thread(target=watch, name="overlap-init-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        over.set()
        thread.join()


def _translated(exc: BaseException, said: str, rank: int, world: int, timeout_s: float) -> Any:
    """torch's failure of the rendezvous in words that name the cause and the fix (None
    when it is not one of those)."""
    text = str(exc)
    fix = (
        f"Start every rank with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE={world}; "
        "ranks on other hosts need that port open to them. Or give init_distributed a longer "
        "timeout="
    )
    clients = re.search(r"(\d+)/(\d+) clients joined", text)
    if clients:
        came = int(clients.group(1)) - 1
        return CommTimeoutError(
            f"init_distributed: rank 0 waited {timeout_s:g} s at {said} for the other "
            f"{world - 1} rank(s) to connect, and {came} did. {fix}"
        )
    if "trying to connect to" in text or "Connection refused" in text:
        return CommTimeoutError(
            f"init_distributed: rank {rank} could not reach rank 0 at {said} within "
            f"{timeout_s:g} s: rank 0 has not started (or has failed), it listens at another "
            f"MASTER_ADDR or MASTER_PORT, or a firewall blocks the port. {fix}"
        )
    if "EADDRINUSE" in text or "ddress already in use" in text:
        return CommError(
            f"init_distributed: rank 0 cannot serve the rendezvous at {said}: the port is in "
            "use on its host (another job, an earlier run still ending, or a second process "
            "started as rank 0). Choose another MASTER_PORT, the same on every rank "
            "(torchrun --master-port)"
        )
    return None


def join(
    init_method: str,
    backend: str,
    rank: int,
    world_size: int,
    timeout: datetime.timedelta,
    debug: bool,
) -> Any:
    """The store of this job's rendezvous at ``init_method``, once every rank has met
    there and agreed (:func:`~overlap.comm.handshake.handshake`); errors as the module
    says. ``rank`` and ``world_size`` are this process's."""
    host, said = where(init_method)
    check_address(host, said)
    check_ifname(backend)
    timeout_s = timeout.total_seconds()
    if rank == 0 and world_size > 1:
        waits = f"at {said} for the other {world_size - 1} rank(s) to connect"
    else:
        waits = f"to reach rank 0 at {said}"
    progress = Progress(waits)
    with logged_wait(rank, progress, timeout_s):
        try:
            met = rendezvous(init_method, rank, world_size, timeout=timeout)
            store, rank, world_size = next(met)
        except Exception as exc:
            better = _translated(exc, said, rank, world_size, timeout_s)
            if better is None:
                raise
            raise better from exc
        store.set_timeout(timeout)
        if world_size == 1:
            return store
        mine = record(rank, world_size, backend, debug)
        try:
            handshake(store, mine, timeout_s, progress)
        except (ValueError, CommTimeoutError):
            raise
        except Exception as exc:  # the store failed under it: rank 0, which serves it, left
            raise CommError(
                f"init_distributed: rank {rank} lost the rendezvous store at {said} during "
                f"the handshake ({exc}): rank 0, which serves it, has failed or left"
            ) from exc
    return store
