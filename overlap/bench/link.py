"""A bandwidth-shaped loopback link: a network namespace whose ``lo`` goes through tbf.

``shaped_link("1gbit")`` creates namespace ``overlap-<pid>``, brings its loopback up and
shapes it (``tc qdisc add dev lo root tbf rate RATE burst 512kb latency 100ms``); commands run
inside it with the returned prefix (``ip netns exec NAME``). Only loopback addresses are used.
Needs root (CAP_NET_ADMIN); without it, :class:`LinkError` says so.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from collections.abc import Iterator

__all__ = ["LinkError", "shaped_link"]


class LinkError(RuntimeError):
    """The shaped link could not be set up (not root, or iproute2 missing)."""


_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit)$", re.IGNORECASE)


def _run(*cmd: str) -> None:
    out = subprocess.run(list(cmd), capture_output=True, text=True)
    if out.returncode != 0:
        raise LinkError(f"{' '.join(cmd)} failed: {out.stderr.strip()}")


@contextlib.contextmanager
def shaped_link(rate: str) -> Iterator[list[str]]:
    """Yield a command prefix that runs a command inside a namespace shaped to ``rate``."""
    if not _RATE.match(rate):
        raise ValueError(f"--link takes a tc rate such as 10gbit or 1gbit, got {rate!r}")
    if os.geteuid() != 0:
        raise LinkError(
            "--link needs root (it creates a network namespace and shapes its "
            "loopback with tc); run as root or drop --link"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise LinkError(f"--link needs `{tool}` (apt-get install iproute2)")
    name = f"overlap-{os.getpid()}"
    _run("ip", "netns", "add", name)
    try:
        _run("ip", "-n", name, "link", "set", "lo", "up")
        _run(
            "ip",
            "netns",
            "exec",
            name,
            "tc",
            "qdisc",
            "add",
            "dev",
            "lo",
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            "512kb",
            "latency",
            "100ms",
        )
        yield ["ip", "netns", "exec", name]
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)
