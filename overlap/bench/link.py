"""A bandwidth-shaped loopback link: a network namespace whose ``lo`` goes through tbf.

``shaped_link("1gbit")`` creates namespace ``ovh<pid>-link``, brings its loopback up and
shapes it (``tc qdisc add dev lo root tbf rate RATE burst 512kb latency 100ms``); commands run
inside it with the returned prefix (``ip netns exec NAME``). Only loopback addresses are used.
Needs root (CAP_NET_ADMIN); without it, :class:`LinkError` says so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence

from overlap.bench.guard import NETNS_ETC, Guardian, remove_namespace
from overlap.bench.stopping import terminate_as_exit

__all__ = ["LinkError", "check_rate", "require_root", "shaped_link"]

log = logging.getLogger(__name__)


class LinkError(RuntimeError):
    """The shaped link could not be set up (not root, or iproute2 missing)."""


_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)$", re.IGNORECASE)


def check_rate(rate: str, what: str = "--link") -> str:
    """``rate`` if it is a positive tc rate (``1gbit``, ``100mbit``, ``2.5gbit``); else a
    ValueError naming ``what`` and the form, before anything is made."""
    m = _RATE.match(rate)
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(
            f"{what} takes a positive tc rate such as 10gbit, 1gbit or 100mbit, got {rate!r}"
        )
    return rate


def _run(*cmd: str) -> None:
    out = subprocess.run(list(cmd), capture_output=True, text=True)
    if out.returncode != 0:
        raise LinkError(f"{' '.join(cmd)} failed: {out.stderr.strip()}")


def _hosts_file(name: str, hosts: Sequence[tuple[str, str]] = ()) -> None:
    """Give namespace ``name`` an /etc/hosts: the machine's, plus the IPv4-mapped loopback
    and each ``(address, host name)`` of ``hosts`` in both forms.

    torch's c10d store names the peer of every connection it accepts. On a dual-stack
    socket an IPv4 peer is ``::ffff:a.b.c.d``, which /etc/hosts does not list, so the lookup
    goes to DNS; inside a namespace no name server is reachable, and each connection printed
    "[c10d] The hostname of the client socket cannot be retrieved. err=-3" (three in every
    demo run). A real cluster's hosts resolve each other; these now do too."""
    try:
        with open("/etc/hosts") as f:
            base = f.read()
    except OSError:
        base = "127.0.0.1 localhost\n"
    lines = [base.rstrip("\n"), "# overlap's, for this namespace", "::ffff:127.0.0.1 localhost"]
    for addr, host in hosts:
        lines += [f"{addr} {host}", f"::ffff:{addr} {host}"]
    folder = os.path.join(NETNS_ETC, name)
    try:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "hosts"), "w") as f:
            f.write("\n".join(lines) + "\n")
    except OSError as exc:  # a read-only /etc: the namespace works, torch only warns more
        log.warning(
            "could not give namespace %s its own hosts file (%s): torch's c10d may "
            "warn that it cannot name its peers",
            name,
            exc,
        )


def require_root(what: str, makes: str, *tools: str) -> None:
    """LinkError unless this process is root and has ``ip``, ``tc`` and ``tools``."""
    if os.geteuid() != 0:
        raise LinkError(f"{what} needs root (it creates {makes}); run as root")
    for tool in ("ip", "tc", *tools):
        if shutil.which(tool) is None:
            pkg = "util-linux" if tool == "unshare" else "iproute2"
            raise LinkError(f"{what} needs `{tool}` (apt-get install {pkg})")


@contextlib.contextmanager
def shaped_link(rate: str) -> Iterator[list[str]]:
    """Yield a command prefix that runs a command inside a namespace shaped to ``rate``.

    The namespace is removed on the way out, with anything still running in it, also when
    the caller is stopped by an exception or SIGTERM, and by a guardian process when the
    caller is killed by SIGKILL (overlap.bench.guard). Its name, ``ovh<pid>-link``, is one
    that :func:`overlap.bench.hosts.sweep_stale` removes once ``pid`` is gone, should the
    guardian have been killed as well."""
    check_rate(rate)
    require_root("--link", "a network namespace and shapes its loopback with tc")
    from overlap.bench.hosts import sweep_stale  # hosts builds on this module

    sweep_stale()
    name = f"ovh{os.getpid()}-link"
    guard = Guardian()
    try:
        guard.namespace(name)
        _run("ip", "netns", "add", name)
        try:
            _hosts_file(name)
            _run("ip", "-n", name, "link", "set", "lo", "up")
            _run(
                *["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root"],
                *["tbf", "rate", rate, "burst", "512kb", "latency", "100ms"],
            )
            with terminate_as_exit():
                yield ["ip", "netns", "exec", name]
        finally:
            remove_namespace(name)
    finally:
        guard.release()
