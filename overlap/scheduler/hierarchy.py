"""Hierarchical reduction: uncompressed inside a host, compressed between hosts.

Inside a host the links are fast (shared memory, NVLink, loopback); between hosts they are
slow, and that is where compression pays (Horovod's hierarchical allreduce, ZeRO++'s
hierarchical quantized gradients). :class:`Hierarchical` wraps a compressor so that one
bucket of L local ranks on N hosts is reduced in three steps:

1. an averaging allreduce of the whole bucket among the host's L ranks (uncompressed);
2. local rank l reduces chunk l of it (1/L of the bucket) with the wrapped compressor among
   the N ranks that have local rank l, one per host: each host sends 1/L of the bucket per
   rank, compressed, and the L chunks cross the slow link in parallel;
3. an allgather of the L chunks among the host's ranks rebuilds the whole average.

Every rank ends with the same buffer: step 2 gives one result per chunk to every member of
its group (the wrapped compressor's contract), step 3 copies it to every rank. The average
is the mean over hosts of the host means, which is the mean over all ranks when every host
has L ranks (required).

The groups come from a :class:`~overlap.topology.ProcessTopology` with axes
``["node", "local"]``: a rank r is (node r // L, local r % L), the layout torchrun and
``mpiexec -ppn L`` give. ``layout(...)`` checks it against every rank's reported node.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from overlap import comm
from overlap.comm.steps import Steps
from overlap.compression.base import Compressor
from overlap.topology import ProcessTopology

__all__ = ["Hierarchical", "node_layout", "resolve"]

log = logging.getLogger(__name__)


def node_layout(ctrl: Any, device: torch.device) -> tuple[int, int] | None:
    """(hosts N, ranks per host L) when every rank agrees that rank r sits on host r // L,
    from each rank's node rank (all-gathered on ``ctrl``); None when the job is on one host
    or is laid out otherwise (then only a flat reduction is right)."""
    world = comm.get_world_size(ctrl)
    mine = torch.tensor([comm.get_node_rank(), comm.get_local_world_size()], device=device)
    table = [torch.zeros_like(mine) for _ in range(world)]
    comm.all_gather(table, mine, group=ctrl)
    nodes = [int(t[0]) for t in table]
    sizes = {int(t[1]) for t in table}
    if len(sizes) != 1:
        return None
    local = sizes.pop()
    if local < 1 or world % local:
        return None
    hosts = world // local
    if nodes != [r // local for r in range(world)]:
        return None
    return hosts, local


def resolve(hierarchy: str, layout: tuple[int, int] | None, group_is_world: bool) -> bool:
    """True when the reduction should be hierarchical; ValueError for a bad request."""
    if hierarchy not in ("auto", "flat", "node"):
        raise ValueError(f"hierarchy must be 'auto', 'flat' or 'node', got {hierarchy!r}")
    if hierarchy == "flat":
        return False
    usable = group_is_world and layout is not None and layout[0] > 1 and layout[1] > 1
    if hierarchy == "node" and not usable:
        why = (
            "it reduces over the whole job, not a sub-group"
            if not group_is_world
            else "the job is on one host, has one process per host, or its ranks are not "
            "laid out host by host (rank r on host r // processes-per-host)"
            if layout is None or layout[0] == 1 or layout[1] == 1
            else "its layout is not usable"
        )
        raise ValueError(
            f"hierarchy='node' needs several hosts with several processes each, but {why}: "
            "use hierarchy='flat' (or 'auto', which picks flat here)"
        )
    return usable


class Hierarchical(Compressor):
    """``inner`` applied between hosts, plain averaging inside them (module docstring).

    Build it on every rank, in the same order (it creates process groups)."""

    name = "hierarchical"
    summable = False

    def __init__(self, inner: Compressor, hosts: int, local: int, group: Any = None) -> None:
        if hosts * local != comm.get_world_size(group):
            raise ValueError(f"{hosts} hosts x {local} ranks is not the world size")
        self.inner = inner
        self.hosts, self.local = hosts, local
        topo = ProcessTopology(["node", "local"], [hosts, local])
        rank = comm.get_rank()
        self._groups = []
        self.local_group: Any = None
        self.cross_group: Any = None
        for ranks in topo.get_axis_comm_lists("local"):  # the ranks of one host
            g = comm.new_group(ranks)
            self._groups.append(g)
            if rank in ranks:
                self.local_group = g
        for ranks in topo.get_axis_comm_lists("node"):  # one rank per host
            g = comm.new_group(ranks)
            self._groups.append(g)
            if rank in ranks:
                self.cross_group = g
        self.local_rank = rank % local
        self.state: dict[Any, Any] = {}
        log.info(
            "hierarchical reduction: %d hosts x %d ranks, %r between hosts", hosts, local, inner
        )

    def __repr__(self) -> str:
        return f"Hierarchical({self.inner!r}, hosts={self.hosts}, local={self.local})"

    def reduce_steps(
        self,
        key: Hashable,
        flat: torch.Tensor,
        *,
        group: Any = None,
        shapes: Sequence[torch.Size] | None = None,
        outputs: Sequence[tuple[int, torch.Tensor]] = (),
    ) -> Steps:
        n, L = flat.numel(), self.local
        yield [comm.all_reduce(flat, op="avg", group=self.local_group, async_op=True)]
        per = -(-n // L)
        buf = self.state.get(key)
        if buf is None or buf.numel() != per * L or buf.dtype != flat.dtype:
            buf = self.state[key] = torch.zeros(per * L, dtype=flat.dtype, device=flat.device)
        buf[:n].copy_(flat)
        chunks = list(buf.view(L, per).unbind(0))
        mine = chunks[self.local_rank]
        yield from self.inner.reduce_steps((key, "chunk"), mine, group=self.cross_group)
        yield [comm.all_gather(chunks, mine.clone(), group=self.local_group, async_op=True)]
        flat.copy_(buf[:n])
        return flat

    def step_end_steps(self, group: Any, device: torch.device) -> Steps | None:
        return self.inner.step_end_steps(group, device)  # e.g. an Auto's decision

    def statistics(self) -> dict[str, Any]:
        stats = getattr(self.inner, "statistics", None)
        inner = stats() if callable(stats) else {"name": self.inner.name}
        return {**inner, "hierarchy": {"hosts": self.hosts, "local": self.local}}

    def begin_step(self) -> None:
        self.inner.begin_step()

    def end_step(self) -> None:
        self.inner.end_step()

    def wire_bytes(self, flat: torch.Tensor, group: Any = None) -> int:
        """What crosses the slow link per rank: the inner compressor's bytes for one chunk."""
        chunk = flat.new_empty(-(-flat.numel() // self.local))
        return self.inner.wire_bytes(chunk, self.cross_group)

    def reset(self) -> None:
        self.state.clear()
        self.inner.reset()

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "inner": self.inner.state_dict()}

    def check_state(self, state: dict[str, Any]) -> None:
        super().check_state(state)
        self.inner.check_state(state["inner"])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        self.inner.load_state_dict(state["inner"])

    def destroy(self) -> None:
        """Free the groups this made (collective: every rank, at a step boundary)."""
        groups, self._groups = self._groups, []
        for g in groups:
            comm.destroy_process_group(g)
