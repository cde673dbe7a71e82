"""Which network interface reaches the master: so gloo (and NCCL's bootstrap) need no
GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME by hand on a multi-host job.

Left alone, gloo binds to the address its host name resolves to. On many machines (and in
network namespaces, which share the host name) that is a loopback address, so ranks on
other hosts cannot connect and the job hangs until the timeout. The right interface is the
one the kernel routes the master's address through: a UDP socket "connected" to the master
(nothing is sent) tells the local address, and the interface holding that address is the
answer. On the master's own host the route is local and the local address is the master's
own, still on the interface the other hosts reach.

Nothing is changed when the variable is already set, when the master is a loopback address
(a single-host job), or when no interface can be found (gloo's own default then applies).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import struct
import sys

__all__ = ["advertised_address", "interface_for", "local_address_for", "set_socket_ifname"]

log = logging.getLogger(__name__)
_SIOCGIFADDR = 0x8915


def local_address_for(host: str, port: int = 29500) -> str | None:
    """The local IPv4 address the kernel would use to reach ``host`` (None if unroutable)."""
    try:
        addr = socket.gethostbyname(host)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, port))  # UDP: picks the route, sends nothing
            local: str = s.getsockname()[0]
            return local
    except OSError:
        return None


def _iface_addresses() -> dict[str, str]:
    """{interface: IPv4 address} (Linux ioctl; empty elsewhere)."""
    if not sys.platform.startswith("linux"):
        return {}
    import fcntl

    out = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                req = struct.pack("256s", name[:15].encode())
                out[name] = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
    return out


def interface_for(host: str, port: int = 29500) -> str | None:
    """The name of the interface that reaches ``host`` from here (None if unknown)."""
    local = local_address_for(host, port)
    if local is None:
        return None
    return next((n for n, a in _iface_addresses().items() if a == local), None)


def set_socket_ifname(master: str | None, port: int = 29500) -> str | None:
    """Set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME (each only if unset) to the interface
    that reaches ``master``; return the interface set, or None if nothing was done."""
    if not master:
        return None
    if "GLOO_SOCKET_IFNAME" in os.environ and "NCCL_SOCKET_IFNAME" in os.environ:
        return None
    try:
        if ipaddress.ip_address(socket.gethostbyname(master)).is_loopback:
            return None  # one host: gloo's default (loopback) is right
    except (OSError, ValueError):
        return None
    name = interface_for(master, port)
    if name is None:
        log.warning(
            "no network interface found that reaches the master %s; set GLOO_SOCKET_IFNAME "
            "(and NCCL_SOCKET_IFNAME) if ranks on other hosts cannot connect",
            master,
        )
        return None
    os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", name)
    log.info("init_distributed: interface %s reaches the master %s", name, master)
    return name


def advertised_address() -> str:
    """An address of this host that other hosts can reach, for a master found without a
    launcher (under mpiexec): the host name's address when it is not loopback (Debian
    maps the host name to 127.0.1.1), else the first non-loopback IPv4 interface address,
    else 127.0.0.1."""
    with contextlib.suppress(OSError):
        addr = socket.gethostbyname(socket.gethostname())
        if not ipaddress.ip_address(addr).is_loopback:
            return addr
    for _, addr in sorted(_iface_addresses().items()):
        if not ipaddress.ip_address(addr).is_loopback:
            return addr
    return "127.0.0.1"
