"""Several simulated hosts on one machine: network namespaces behind a shaped switch.

``namespace_hosts(2, link="1gbit")`` makes, as root:

* a hub namespace ``ovh<pid>-hub`` holding a bridge (the switch; a cluster made while
  another of the process is alive is ``ovh<pid>c<k>-*``);
* per host i a namespace ``ovh<pid>-<i>`` with its loopback up and an ``eth0`` (one end of a
  veth pair whose other end is on the bridge), address ``10.77.0.<i+1>/24``;
* with ``link``: ``tc tbf`` on each host's ``eth0`` egress, so every host sends at most
  ``link`` to the others (a NIC's rate); traffic inside a host (its loopback) is unshaped,
  as it is between processes of one machine.

Only the addresses made here are used: nothing leaves the namespaces. Clean-up is
guaranteed: the namespaces (and so the veths and the bridge) are deleted on the way out,
with whatever still runs in them, also on an exception or SIGTERM. For a run killed by
SIGKILL a guardian process, started before anything is made, removes the namespaces, their
/etc/netns files and the cluster's temporary folder within moments of its death
(overlap.bench.guard). Should the guardian be killed too, the next ``namespace_hosts`` (or
``shaped_link``) deletes every ``ovh<pid>-*`` namespace and temporary folder whose pid is
no longer alive before it makes its own.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from overlap.bench.agent import quiet_cpp_env
from overlap.bench.guard import Guardian, remove_namespace
from overlap.bench.link import (
    _hosts_file,
    _run,
    check_rate,
    require_root,
)
from overlap.bench.stopping import python_module, terminate_as_exit
from overlap.runtime import pid_alive

__all__ = ["Cluster", "Host", "namespace_hosts", "sweep_stale"]

SUBNET = "10.77.0"
RUN = "torch.distributed.run"  # torchrun, as a module
# ovh<pid>-*, and ovh<pid>c<k>-* for a process's second and later clusters alive at once
_NAME = re.compile(r"^ovh(\d+)(?:c\d+)?-")
_live: set[str] = set()  # the tags of this process's clusters now alive
_live_lock = threading.Lock()


def _claim_tag() -> str:
    """A name tag no live cluster of this process has: ``ovh<pid>``, or ``ovh<pid>c<k>``
    while others are alive (a cluster made inside another's ``with``). Before, the second
    failed with ip's "Cannot create namespace file ... File exists"."""
    base = f"ovh{os.getpid()}"
    with _live_lock:
        tag, k = base, 0
        while tag in _live:
            k += 1
            tag = f"{base}c{k}"
        _live.add(tag)
    return tag


@dataclass(frozen=True)
class Host:
    """One simulated host: its namespace, its address on the switch, and its index."""

    index: int
    netns: str
    addr: str
    ifname: str = "eth0"

    def prefix(self) -> list[str]:
        """The command prefix that runs a command on this host: in its network namespace,
        and in a UTS namespace of its own whose host name is the network namespace's name
        (so MPI's processor names, and anything else that asks, tell the hosts apart)."""
        return [
            *["ip", "netns", "exec", self.netns, "unshare", "--uts", "sh", "-c"],
            f'hostname {self.netns} && exec "$@"',
            "sh",
        ]

    def popen(self, cmd: list[str], **kwargs: object) -> subprocess.Popen[str]:
        """Start ``cmd`` on this host (text mode; other Popen keywords pass through)."""
        return subprocess.Popen([*self.prefix(), *cmd], text=True, **kwargs)  # type: ignore[call-overload, no-any-return]


class Cluster(list[Host]):
    """The hosts of :func:`namespace_hosts`, with the launcher arguments that start a job on
    them (what a cluster's hostfile and ssh would give)."""

    launcher: str = ""  # hydra's ssh launcher stand-in: runs the proxy on the named host
    tmp: str = ""  # a directory of the cluster's, removed with its hosts
    guardian: int = 0  # pid of the process that removes them if this one is killed (or 0)

    def torchrun_args(self, host: Host, procs_per_host: int, run_id: str) -> list[str]:
        """torchrun's multi-node arguments for ``host`` (c10d rendezvous on host 0). Host
        names here resolve to nothing, so each agent is told its address (--local-addr)
        and host 0 that it serves the rendezvous (is_host)."""
        return [
            *["--nnodes", str(len(self)), "--nproc-per-node", str(procs_per_host)],
            *["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self[0].addr}:29400"],
            *["--rdzv-id", run_id, "--local-addr", host.addr, "--max-restarts", "0"],
            *["--rdzv-conf", f"is_host={int(host.index == 0)}"],
            # torchrun's error files go under the cluster's own directory, removed with it
            # (left to itself each agent makes a /tmp/torchelastic_* and never removes it)
            *["--log-dir", os.path.join(self.tmp, "torchrun")],
        ]

    def torchrun(
        self, argv: list[str], procs_per_host: int, *, quiet: bool = False, **popen: Any
    ) -> list[subprocess.Popen[str]]:
        """Start ``torchrun ... argv`` (a script and its arguments, or ``-m module ...``) on
        every host, one job; the Popen keywords (stdout, env, cwd, ...) apply to each.
        ``quiet``: each agent is :mod:`overlap.bench.agent` (torchrun with no traceback on
        Ctrl-C and no elastic warnings), as the CLI runs them."""
        run_id = uuid.uuid4().hex[:8]
        # quiet: the agent's own imports too (stopping.python_module)
        agent = python_module("overlap.bench.agent") if quiet else [sys.executable, "-m", RUN]
        if quiet:
            popen["env"] = quiet_cpp_env(popen.get("env"))
        return [
            h.popen(
                [
                    *agent,
                    *self.torchrun_args(h, procs_per_host, run_id),
                    *argv,
                ],
                **popen,
            )
            for h in self
        ]

    def srun_env(self, procs_per_host: int, job_id: int = 4242) -> list[dict[str, str]]:
        """The environment srun gives each task of a step of ``procs_per_host`` tasks on
        every host (srun(1), "OUTPUT ENVIRONMENT VARIABLES"), in rank order, block
        distribution: what ``srun python train.py`` would start, less srun itself (a
        cluster's slurmd). The node list is a hostlist expression, as SLURM writes it."""
        n, tag = len(self), self[0].netns.rsplit("-", 1)[0]
        nodes = f"{tag}-[0-{n - 1}]" if n > 1 else self[0].netns
        step = {
            "SLURM_JOB_ID": str(job_id),
            "SLURM_STEP_ID": "0",
            "SLURM_NTASKS": str(n * procs_per_host),
            "SLURM_JOB_NODELIST": nodes,
            "SLURM_STEP_NODELIST": nodes,
            "SLURM_STEP_NUM_NODES": str(n),
            "SLURM_STEP_NUM_TASKS": str(n * procs_per_host),
            "SLURM_STEP_TASKS_PER_NODE": f"{procs_per_host}(x{n})",
        }
        return [
            {
                **step,
                "SLURM_PROCID": str(h.index * procs_per_host + local),
                "SLURM_LOCALID": str(local),
                "SLURM_NODEID": str(h.index),
            }
            for h in self
            for local in range(procs_per_host)
        ]

    def srun(
        self, argv: list[str], procs_per_host: int, env: dict[str, str], **popen: Any
    ) -> list[subprocess.Popen[str]]:
        """Start ``argv`` as every task of one srun step (:meth:`srun_env`), each on its
        host with ``env`` plus its SLURM variables; the Popen keywords apply to each."""
        tasks = self.srun_env(procs_per_host)
        return [
            self[i // procs_per_host].popen(argv, env={**env, **task}, **popen)
            for i, task in enumerate(tasks)
        ]

    def mpiexec_args(self, procs_per_host: int) -> list[str]:
        """mpiexec's arguments for ``procs_per_host`` ranks on every host (run mpiexec on host
        0): hydra starts its proxies through :attr:`launcher`, as it would through ssh."""
        return [
            *["-launcher", "ssh", "-launcher-exec", self.launcher, "-localhost", self[0].addr],
            *["-hosts", ",".join(h.addr for h in self), "-n", str(len(self) * procs_per_host)],
            *["-ppn", str(procs_per_host)],
        ]


_LAUNCHER = r"""#!/bin/sh
# hydra's ssh launcher calls: launcher -x HOST "COMMAND"; run COMMAND on HOST
[ "$1" = "-x" ] && shift
host="$1"; shift
case "$host" in
{cases}
  *) echo "no namespace host $host" >&2; exit 1;;
esac
exec ip netns exec "$ns" unshare --uts sh -c "hostname $ns && exec sh -c \"\$0\"" "$*"
"""


def sweep_stale() -> list[str]:
    """Delete the ``ovh<pid>-*`` namespaces, and the ``ovh<pid>-*`` temporary folders, of
    processes that are gone; return their names (the folders by path)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    gone = []
    for line in out.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _NAME.match(name)
        if m and not pid_alive(int(m.group(1))):
            remove_namespace(name)
            gone.append(name)
    tmp = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for entry in os.scandir(tmp):
            m = _NAME.match(entry.name)
            if m and entry.is_dir(follow_symlinks=False) and not pid_alive(int(m.group(1))):
                shutil.rmtree(entry.path, ignore_errors=True)
                gone.append(entry.path)
    return gone


@contextlib.contextmanager
def namespace_hosts(n: int = 2, link: str | None = None) -> Iterator[Cluster]:
    """Yield ``n`` hosts (namespaces on one shaped switch); remove them all on the way out."""
    if not 1 <= n <= 200:
        raise ValueError(f"namespace_hosts makes 1 to 200 hosts, got {n}")
    if link is not None:
        check_rate(link, "link")
    require_root("namespace hosts", "network namespaces, veth pairs and a bridge", "unshare")
    sweep_stale()
    tag = _claim_tag()
    hub = f"{tag}-hub"
    made: list[str] = []
    tmp: str | None = None
    guard = Guardian()
    try:
        tmp = tempfile.mkdtemp(prefix=f"{tag}-")
        guard.folder(tmp)
        with terminate_as_exit():
            guard.namespace(hub)
            made.append(hub)
            _run("ip", "netns", "add", hub)
            _run("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", hub, "link", "set", "br0", "up")
            hosts = Cluster()
            hosts.guardian = guard.pid
            for i in range(n):
                ns = f"{tag}-{i}"
                guard.namespace(ns)
                made.append(ns)
                _run("ip", "netns", "add", ns)
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                # made in the host's namespace, the peer end moved to the hub
                _run("ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}")
                _run("ip", "-n", ns, "link", "set", f"p{i}", "netns", hub)
                _run("ip", "-n", hub, "link", "set", f"p{i}", "master", "br0")
                _run("ip", "-n", hub, "link", "set", f"p{i}", "up")
                addr = f"{SUBNET}.{i + 1}"
                _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
                _run("ip", "-n", ns, "link", "set", "eth0", "up")
                if link is not None:
                    _run(
                        *["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0"],
                        *["root", "tbf", "rate", link, "burst", "512kb", "latency", "100ms"],
                    )
                hosts.append(Host(i, ns, addr))
            for h in hosts:  # every host resolves every other, as on a cluster
                _hosts_file(h.netns, [(o.addr, o.netns) for o in hosts])
            hosts.tmp = tmp
            hosts.launcher = os.path.join(tmp, "launcher")
            cases = "\n".join(f"  {h.addr}) ns={h.netns};;" for h in hosts)
            with open(hosts.launcher, "w") as f:
                f.write(_LAUNCHER.format(cases=cases))
            os.chmod(hosts.launcher, 0o755)
            yield hosts
    finally:
        for ns in reversed(made):
            remove_namespace(ns)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        guard.release()
        with _live_lock:
            _live.discard(tag)
