"""Hierarchical reduction: uncompressed inside a host, compressed between hosts.

Inside a host the links are fast (shared memory, NVLink, loopback); between hosts they are
slow, and that is where compression pays (Horovod's hierarchical allreduce, ZeRO++'s
hierarchical quantized gradients). :class:`Hierarchical` wraps a compressor so that one
bucket of L local ranks on N hosts is reduced in three steps:

1. inside the host, local rank l gets chunk l (1/L of the bucket) averaged over the host's
   L ranks (uncompressed);
2. it reduces that chunk with the wrapped compressor among the N ranks that have local
   rank l, one per host: each host sends 1/L of the bucket per rank, compressed, and the L
   chunks cross the slow link in parallel;
3. inside the host, every rank gets the L reduced chunks: the whole average.

On CPU, steps 1 and 3 go through shared memory (``/dev/shm``), as NCCL's SHM transport
does: each rank writes its bucket, less its own chunk, into its slot of a region the host's
ranks all map, averages its own chunk from its gradients and the other slots (with two
ranks a host, one ``lerp``), and after step 2 publishes the chunk for the others to read;
two small barriers on the host's group order it. When the wrapped compressor is a 1-bit
one past its warm-up, the chunk is published in its compressed form (the server scales and
the packed signs, 1/32 of the floats) and every rank rebuilds all L chunks from there
straight into its own gradients: the owner does not rebuild its chunk into the region, nor
does every rank copy the whole result out of it (per rank, one write of the bucket where
there were half a write, a read and a write). With one or two ranks a host the 1-bit
encode pass also takes the chunk's mean itself, reading this rank's gradients and the
peer's slot where they are: the mean is never written out and read back. With L = 2 that
is half a pass of the bucket in, the encode's reads, and one write out; sockets on
loopback (an allreduce, then an allgather) cost far more CPU (docs/cluster.md). These
passes run on cold memory that the host's ranks share, so on CPU they cost about as much
as the codec work they save: docs/cluster.md has the measurements. A region is mapped by
every rank and then unlinked, so nothing is left in /dev/shm even after a crash; without
room there (a container's 64 MB default), the host falls back to the socket path, saying so.

Every rank ends with the same buffer: step 2 gives one result per chunk to every member of
its group (the wrapped compressor's contract), step 3 copies it (or rebuilds it from the
same bits, with the same kernel: bitwise the same floats) to every rank. A non-finite
chunk is seen only by the ranks that reduce it (a NaN on one rank reaches one chunk), so the
host's ranks agree on it before step 3, in the barrier that orders it (a max over their
outcomes, no extra collective on the shared-memory path): with ``on_nonfinite="raise"``
every rank raises NonFiniteError together, with ``"skip"`` every rank's bucket is NaN and its
compressor's ``last_skipped`` is set, as a flat reduction leaves them. Without that, the
owner of the chunk left the step one barrier early: the others read a result it never
wrote (different gradients on each rank, silently, with "skip"), or the host's barriers
paired across buckets until gloo failed. The average
is the mean over hosts of the host means, which is the mean over all ranks when every host
has L ranks (required).

The groups come from a :class:`~overlap.topology.ProcessTopology` with axes
``["node", "local"]``: a rank r is (node r // L, local r % L), the layout torchrun and
``mpiexec -ppn L`` give. ``layout(...)`` checks it against every rank's reported node.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch

from overlap import comm
from overlap.comm.objects import _device
from overlap.comm.steps import Steps
from overlap.compression.base import Compressor, steps_of
from overlap.compression.codec import codec_for, gather_sources, write_outputs
from overlap.compression.layout import Layout, layout
from overlap.compression.nonfinite import nan_result
from overlap.compression.onebit import OneBit
from overlap.compression.quantize import _BlockQuantized
from overlap.errors import NonFiniteError
from overlap.runtime import pid_alive
from overlap.topology import ProcessTopology

__all__ = ["Hierarchical", "check_hierarchy", "chunk_segments", "node_layout", "resolve"]

log = logging.getLogger(__name__)
_SHM = "/dev/shm"
# How a rank's chunk ended (the host takes the max of its ranks'): see Hierarchical._agree
_OK, _SKIPPED, _RAISED = 0, 1, 2
# What a chunk's owner left in its part of the shared result (each rank's vote says it):
# the averaged floats, or the inner 1-bit reduction's signs and scales (Hierarchical._publish)
_FLOATS, _SIGNS = 0, 1


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


def check_hierarchy(hierarchy: str) -> None:
    """ValueError unless ``hierarchy`` is one of the three names."""
    if hierarchy not in ("auto", "flat", "node"):
        raise ValueError(f"hierarchy must be 'auto', 'flat' or 'node', got {hierarchy!r}")


def resolve(hierarchy: str, layout: tuple[int, int] | None, group_is_world: bool) -> bool:
    """True when the reduction should be hierarchical; ValueError for a bad request."""
    check_hierarchy(hierarchy)
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


def _gaps(n: int, outputs: Sequence[tuple[int, torch.Tensor]]) -> list[tuple[int, int]]:
    """The ranges of [0, n) that no (start, tensor) of ``outputs`` covers."""
    out, at = [], 0
    for a, t in sorted(outputs, key=lambda o: o[0]):
        if a > at:
            out.append((at, a))
        at = max(at, a + t.numel())
    if at < n:
        out.append((at, n))
    return out


def _sources(
    flat: torch.Tensor, outputs: Sequence[tuple[int, torch.Tensor]], read_outputs: bool
) -> list[tuple[int, int, torch.Tensor]]:
    """Where the bucket's input lives, as (start, end, flat view) pieces: ``flat``, or, with
    ``read_outputs``, the outputs that cover their elements and ``flat`` for the rest (and,
    the other way, where its result goes)."""
    if not read_outputs:
        return [(0, flat.numel(), flat.reshape(-1))]
    out = [(a, b, flat[a:b]) for a, b in _gaps(flat.numel(), outputs)]
    return out + [(a, a + t.numel(), t.view(-1)) for a, t in outputs]


def _pieces(
    sources: list[tuple[int, int, torch.Tensor]], lo: int, hi: int
) -> list[tuple[int, int, torch.Tensor]]:
    """The elements [lo, hi) of :func:`_sources`' pieces, as (start, end, source view)."""
    pieces = []
    for a, b, src in sources:
        a2, b2 = max(a, lo), min(b, hi)
        if b2 > a2:
            pieces.append((a2, b2, src[a2 - a : b2 - a]))
    return pieces


def _by_segment(
    sources: list[tuple[int, int, torch.Tensor]], segments: list[int], lo: int, end: int
) -> list[tuple[int, torch.Tensor]]:
    """The bucket's elements [lo, end) from ``sources`` (:func:`_sources`) as (chunk
    position, view) inputs, cut at the chunk's ``segments`` so that each is one whole
    segment and the encode kernel reads it in place (a piece across two segments would be
    copied first)."""
    out, at = [], lo
    for k in segments:
        out += [(a - lo, view) for a, _, view in _pieces(sources, at, min(at + k, end))]
        at += k
    return out


def _compressed_form(room: torch.Tensor, lay: Layout) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Where a chunk's 1-bit result of layout ``lay`` sits in its part of the shared result
    (``room``, float32): the server scales ((W, segments) float32) first, then the packed
    signs (P/8 bytes). None when they do not fit. The owner writes them there
    (:meth:`Hierarchical._publish`) and every rank reads them back
    (:meth:`Hierarchical._rebuild`) through this one description of the format."""
    ns, nb = lay.w * lay.nseg, lay.P // 8
    if 4 * ns + nb > 4 * room.numel():
        return None
    raw = room.view(torch.uint8)
    return raw[: 4 * ns].view(torch.float32).view(lay.w, lay.nseg), raw[4 * ns : 4 * ns + nb]


def chunk_segments(shapes: Sequence[torch.Size] | None, n: int, per: int, j: int) -> list[int]:
    """The lengths of the bucket's tensors within chunk j (elements [j per, (j + 1) per)),
    in order, the chunk's padding past the bucket's ``n`` elements a segment of its own: a
    1-bit reduction of the chunk then gives each tensor piece its own scales, as a flat
    one gives each tensor (OneBit's ``per_tensor_scales``). One segment, the whole chunk,
    without shapes or when they do not describe the bucket."""
    sizes = [int(torch.Size(x).numel()) for x in shapes or ()]
    if sum(sizes) != n or len(sizes) < 2:
        return [per]
    lo, hi, out, at = j * per, (j + 1) * per, [], 0
    for k in sizes:
        a, b = max(at, lo), min(at + k, hi)
        if b > a:
            out.append(b - a)
        at += k
    if hi > max(n, lo):
        out.append(hi - max(n, lo))
    return out


def _sweep_shm() -> None:
    """Remove region files whose creating process is gone: a crash between making a region
    and unlinking it (a few ms) leaves one behind, named ``overlap-<pid>-...``."""
    try:
        names = os.listdir(_SHM)
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        dead = len(parts) == 4 and parts[0] == "overlap" and parts[1].isdigit()
        if dead and not pid_alive(int(parts[1])):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(_SHM, name))


class Hierarchical(Compressor):
    """``inner`` applied between hosts, plain averaging inside them (module docstring).

    Build it on every rank, in the same order (it creates process groups).

    Its reduction is a steps generator like any other, so the scheduler pipelines buckets
    through it (bucket k's exchange inside the host while bucket k-1's 1-bit phases cross
    the slow link). Each phase is one collective on one group, and the phase sequence
    depends only on the bucket order, so the groups inside and between hosts each see the
    same op order on every member (DESIGN.md contract 1)."""

    name = "hierarchical"
    summable = False
    # The scheduler passes the gradients (Compressor.reduce_steps): on the shared-memory
    # path they go straight into this rank's slot and come straight back from the result,
    # saving the copy into the bucket and the copy back out of it (four passes of the
    # bucket per rank, on a path that is otherwise seven or so).
    writes_outputs = True
    reads_outputs = True

    def __init__(
        self,
        inner: Compressor,
        hosts: int,
        local: int,
        group: Any = None,
        device: torch.device | None = None,
    ) -> None:
        """``device``: where the host's small control collectives run (the shared-memory
        token, each chunk's outcome vote); by default the backend's (CUDA on NCCL, which
        reduces only CUDA tensors; else the CPU)."""
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
        self.device = _device(device)
        self.state: dict[Any, Any] = {}
        self._pad: torch.Tensor | None = None  # _rebuild's scratch chunk
        self._fuse = True  # a 1-bit chunk averaged inside its encode (False: tests' reference)
        # this rank's NonFiniteError per bucket, from step 2 until the host agrees on it
        self._nonfinite: dict[Hashable, NonFiniteError] = {}
        # Shared memory for the exchange inside a host (module docstring), named by a token
        # that local rank 0 draws and shares: a job's hosts never collide.
        token = torch.tensor(list(secrets.token_bytes(8)), dtype=torch.uint8, device=self.device)
        comm.broadcast(token, src=rank - self.local_rank, group=self.local_group)
        self._token = token.cpu().numpy().tobytes().hex()
        # local rank 0 names the files
        pid0 = torch.tensor([os.getpid()], dtype=torch.int64, device=self.device)
        comm.broadcast(pid0, src=rank - self.local_rank, group=self.local_group)
        self._pid0 = int(pid0)
        if self.local_rank == 0:
            _sweep_shm()
        self._shm_ok = True
        self._regions = 0  # shared regions named so far (never reused, not even after reset)
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
        read_outputs: bool = False,
    ) -> Steps:
        """``outputs`` and ``read_outputs`` as in :meth:`Compressor.reduce_steps`."""
        if flat.device.type == "cpu":
            region = yield from self._region(key, flat)
            if region is not None:
                return (
                    yield from self._shm_steps(key, flat, region, outputs, read_outputs, shapes)
                )
        if read_outputs:
            gather_sources(flat, outputs)
        yield from self._socket_steps(key, flat, shapes)
        write_outputs(flat, outputs)
        return flat

    def _barrier(self) -> list[Any]:
        return [comm.all_reduce(torch.zeros(1), group=self.local_group, async_op=True)]

    def _inner_chunk(
        self, key: Hashable, chunk: torch.Tensor, kw: dict[str, Any], segments: list[int]
    ) -> Steps:
        """Reduce this rank's chunk across hosts; its outcome: _OK, _SKIPPED (the inner
        compressor kept a non-finite chunk as it was) or _RAISED (it raised NonFiniteError,
        kept per bucket for :meth:`_agree`). The inner compressor's own
        contract makes the outcome the same on every rank of the cross group.

        A 1-bit compressor gets ``segments`` (:func:`chunk_segments`) as the chunk's tensor
        shapes, so each tensor piece has its own scales as in a flat reduction, and ``kw``'s
        OneBit-only keywords (``publish``, ``inputs``, ``mean_with``: the caller adds them
        only when the active compressor is a OneBit); it is called itself (an Auto would
        pass the call on to it unchanged). A block quantizer (Int8, FP8) gets the segments
        too, so each piece starts a block of its own. Any other gets no shapes: 1-D pieces
        are not the bucket's tensors (a PowerSGD would take them for vectors)."""
        cur = self.inner.current()
        before = getattr(cur, "skipped_steps", None)
        target: Compressor = self.inner
        if isinstance(cur, OneBit):
            target = cur
            if len(segments) > 1:
                kw = {**kw, "shapes": [torch.Size([k]) for k in segments]}
        elif isinstance(cur, _BlockQuantized) and not kw:
            target = cur  # its blocks start at each piece (docs/compression.md)
            if len(segments) > 1:
                kw = {"shapes": [torch.Size([k]) for k in segments]}
        elif {"publish", "inputs", "mean_with"} & kw.keys():
            # dropping inputs or mean_with would reduce a chunk that was never written
            raise RuntimeError(f"OneBit-only keywords for {cur!r}: {sorted(kw)}")
        try:
            yield from steps_of(
                target, target.reduce_steps((key, "chunk"), chunk, group=self.cross_group, **kw)
            )
        except NonFiniteError as exc:
            self._nonfinite[key] = exc
            return _RAISED
        # Another pipelined bucket's skip in between counts too: harmless, as that step is
        # skipped anyway, and the count moves at the same phase on every rank.
        return _OK if getattr(cur, "skipped_steps", None) == before else _SKIPPED

    def _agree(self, key: Hashable, outcome: int, kind: int = _FLOATS) -> Steps:
        """The host's barrier after step 2, carrying each rank's chunk outcome and the form
        of its published chunk (``kind``): every rank learns the worst outcome and every
        chunk's form, returned as (worst, forms by local rank). Raises NonFiniteError on
        every rank of the host if any chunk raised; marks this rank's compressor skipped if
        any chunk was skipped."""
        vote = torch.zeros(1 + self.local, dtype=torch.int32, device=self.device)
        vote[0], vote[1 + self.local_rank] = outcome, kind
        yield [comm.all_reduce(vote, op="max", group=self.local_group, async_op=True)]
        worst, *kinds = (int(v) for v in vote.tolist())
        if worst == _RAISED:
            own = self._nonfinite.pop(key, None)
            if outcome == _RAISED and own is not None:
                raise own
            raise NonFiniteError(
                "hierarchical reduction: a chunk of this bucket reduced by another rank of "
                "this host held NaN or Inf; the buffer and the error-feedback state are left "
                "as they were",
                ranks=[],
            )
        if worst == _SKIPPED and outcome != _SKIPPED:
            cur = self.inner.current()  # as if this rank's own chunk had been skipped
            if hasattr(cur, "skipped_steps"):
                cur.skipped_steps += 1
            if hasattr(cur, "last_skipped"):
                cur.last_skipped = True
        return worst, kinds

    def _region(self, key: Hashable, flat: torch.Tensor) -> Steps:
        """This key's shared memory (L input slots and one result, each a padded bucket),
        made once by local rank 0 and mapped by the others; None (socket path from then on)
        when /dev/shm lacks room on any rank of the host."""
        n, L = flat.numel(), self.local
        per = -(-n // L)
        have = self.state.get(("shm", key))
        if have is not None and have[0].shape == (L + 1, per * L) and have[0].dtype == flat.dtype:
            return have
        if not self._shm_ok:
            # This host went to sockets. A host with room makes a region here, in three
            # phases (the vote and two barriers): take as many, empty. The pipeline
            # interleaves the buckets' phases by count; an offset that every bucket of a
            # step shares keeps the exchanges between hosts in the same order on every
            # host, but when only some buckets make a region (a bucket that changed size
            # at a rebuild) the hosts' orders would differ.
            if self.state.get(("sockets", key)) != (n, flat.dtype):
                self.state[("sockets", key)] = (n, flat.dtype)
                for _ in range(3):
                    yield []
            return None
        need = (L + 1) * per * L * flat.element_size()
        try:
            st = os.statvfs(_SHM)
            room = st.f_bavail * st.f_frsize >= 2 * need  # keep half of it free for others
        except OSError:
            room = False
        vote = torch.tensor([0 if room else 1])
        yield [comm.all_reduce(vote, op="max", group=self.local_group, async_op=True)]
        if int(vote):
            self._shm_ok = False
            log.warning(
                "hierarchical reduction: %s has no room for %.0f MB; the exchange inside the "
                "host goes through sockets",
                _SHM,
                need / 2**20,
            )
            self.state[("sockets", key)] = (n, flat.dtype)
            yield []  # the two barriers a host with room takes (above)
            yield []
            return None
        # Regions are named in the order this line runs, the same on every rank of the host
        # (the pipeline's order is fixed). A count of its own, not len(self.state): with
        # buckets pipelined, a second bucket names its region before the first has stored
        # its own, and len(self.state) gave both the same file: two buckets sharing memory,
        # then a failed unlink on local rank 0 only, whose bucket then skipped a barrier
        # the others issued (gloo: "Received data size doesn't match").
        path = os.path.join(_SHM, f"overlap-{self._pid0}-{self._token}-{self._regions}")
        self._regions += 1
        if self.local_rank == 0:
            buf = torch.from_file(path, shared=True, size=(L + 1) * per * L, dtype=flat.dtype)
        try:
            yield self._barrier()
            if self.local_rank != 0:
                buf = torch.from_file(path, shared=True, size=(L + 1) * per * L, dtype=flat.dtype)
            yield self._barrier()
        finally:
            # Every rank has it mapped (or the job broke before that: a barrier failed, the
            # step was abandoned): every rank unlinks it, the first one wins. Any one rank
            # living on past this line is enough for nothing to be left in /dev/shm, where
            # an unlink by local rank 0 alone left the file behind when that rank died
            # between the second barrier and the unlink.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        region = (buf.view(L + 1, per * L), per)
        self.state[("shm", key)] = region
        return region

    def _shm_steps(
        self,
        key: Hashable,
        flat: torch.Tensor,
        region: Any,
        outputs: Sequence[tuple[int, torch.Tensor]],
        read_outputs: bool,
        shapes: Sequence[torch.Size] | None = None,
    ) -> Steps:
        """Inside the host through shared memory: write the bucket, but for this rank's own
        chunk, to this rank's slot; average the own chunk over this rank's values and the
        others' slots; reduce it across hosts, publish it, read them all.

        The own chunk is never written to the slot: only this rank reads it, so it averages
        it straight from its gradients (a copy of 1/L of the bucket saved), and with two
        ranks per host the average is one ``lerp`` (the sum and the division were a pass
        and a half of the chunk). The outputs' elements are read from the outputs themselves
        (``read_outputs``) and come back into them from the result; ``flat`` carries only
        the rest."""
        buf, per = region
        n, L, mine = flat.numel(), self.local, self.local_rank
        slots, result = buf[:L], buf[L]
        slot = slots[mine]
        lo, hi = mine * per, (mine + 1) * per
        mine_n = min(hi, n)  # the own chunk's end within the bucket (padding past it)
        sources = _sources(flat, outputs, read_outputs)
        for a, b, src in _pieces(sources, 0, lo) + _pieces(sources, hi, n):
            slot[a:b].copy_(src)
        yield self._barrier()  # every slot written
        chunk = self.state.get(("chunk", key))
        if chunk is None or chunk.numel() != per or chunk.dtype != flat.dtype:
            chunk = self.state[("chunk", key)] = torch.empty(per, dtype=flat.dtype)
        others = [slots[j] for j in range(L) if j != mine]
        cur = self.inner.current()
        onebit = isinstance(cur, OneBit) and flat.dtype == torch.float32
        cuts = self._segments(key, shapes, n, per)
        segments = cuts[mine]
        # A 1-bit chunk of a host of one or two ranks is averaged inside the encode pass,
        # its inputs read where they are (the mean is never written out and read back)
        fuse = onebit and L <= 2 and self._fuse
        if not fuse:
            for a, b, src in _pieces(sources, lo, mine_n):
                out = chunk[a - lo : b - lo]
                if not others:  # one rank per host: its own values
                    out.copy_(src)
                elif L == 2:  # the mean of two, in one pass
                    torch.lerp(src, others[0][a:b], 0.5, out=out)
                else:
                    torch.add(src, others[0][a:b], out=out)
        if mine_n < hi:
            # padding: every slot holds 0 there (and the fused encode reads it from chunk)
            chunk[max(mine_n - lo, 0) :].zero_()
        if L > 2:
            for other in others[1:]:
                chunk.add_(other[lo:hi])
            chunk.div_(L)
        # a compressor that writes outputs rebuilds straight into the published result; a
        # 1-bit one publishes its compressed result there instead (_publish)
        mine_out = result[lo:hi]
        direct = cur.writes_outputs
        kw: dict[str, Any] = {"outputs": [(0, mine_out)]} if direct else {}
        taken: list[bool] = []
        if onebit:
            want = self._chunk_layout(per, segments)
            kw["publish"] = lambda signs, sscales, lay: self._publish(
                signs, sscales, lay, want, mine_out, taken
            )
        if fuse:
            kw["inputs"] = _by_segment(sources, segments, lo, mine_n)
            if others:
                kw["mean_with"] = others[0][lo:hi]
        outcome = yield from self._inner_chunk(key, chunk, kw, segments)
        if outcome == _OK and not direct:
            mine_out.copy_(chunk)
        # every chunk published, and the host agrees on how its chunks ended
        worst, kinds = yield from self._agree(key, outcome, _SIGNS if taken else _FLOATS)
        if worst != _OK:
            return nan_result(flat, outputs)  # skipped on every rank, as a flat reduction
        # into the outputs (whether or not they held the input) and flat for the rest
        dests = _sources(flat, outputs, bool(outputs))
        for j, kind in enumerate(kinds):
            a0, a1 = j * per, min((j + 1) * per, n)
            if a1 <= a0:
                continue
            if kind == _SIGNS:
                lay = self._chunk_layout(per, cuts[j])
                self._rebuild(result[a0 : a0 + per], lay, _pieces(dests, a0, a1), a0)
            else:
                for a, b, dst in _pieces(dests, a0, a1):
                    dst.copy_(result[a:b])
        return flat

    def _publish(
        self,
        signs: torch.Tensor,
        sscales: torch.Tensor,
        lay: Layout,
        want: Layout,
        dst: torch.Tensor,
        taken: list[bool],
    ) -> bool:
        """Put this rank's reduced chunk into its part of the shared result in the 1-bit
        form: the server scales, then the packed signs (about 1/32 of the floats). Every
        rank of the host then rebuilds every chunk from there straight into its own
        gradients (:meth:`_rebuild`), instead of the owner rebuilding its chunk into the
        result and every rank copying the whole result out: per rank, the bucket written
        once, where it was written, read and written again (half a pass and two). False
        (the floats are published instead) when the form does not fit the chunk's room or
        the reduction's layout is not ``want``, the one every reader rebuilds with (a
        OneBit without per-tensor scales)."""
        if lay is not want and (
            lay.n != want.n or lay.w != want.w or not np.array_equal(lay.seg_len, want.seg_len)
        ):
            return False
        form = _compressed_form(dst, lay)
        if form is None:
            return False
        form[0].copy_(sscales.view(lay.w, lay.nseg))
        form[1].copy_(signs.reshape(-1))
        taken.append(True)
        return True

    def _segments(
        self, key: Hashable, shapes: Sequence[torch.Size] | None, n: int, per: int
    ) -> list[list[int]]:
        """:func:`chunk_segments` of every chunk of this bucket, worked out once per key (a
        loop over the bucket's tensors, per chunk, on every step otherwise)."""
        sig = (n, per, len(shapes or ()))
        have = self.state.get(("segments", key))
        if have is None or have[0] != sig:
            made = [chunk_segments(shapes, n, per, j) for j in range(self.local)]
            have = self.state[("segments", key)] = (sig, made)
        cuts: list[list[int]] = have[1]
        return cuts

    def _chunk_layout(self, per: int, segments: list[int]) -> Layout:
        """The layout of a chunk's 1-bit reduction: ``per`` elements over the hosts, in
        ``segments`` (which rank of the cross group is "me" does not change a rebuild)."""
        return layout(per, self.hosts, comm.get_rank() // self.local, segments)

    def _rebuild(
        self,
        published: torch.Tensor,
        lay: Layout,
        dests: list[tuple[int, int, torch.Tensor]],
        a0: int,
    ) -> None:
        """Rebuild one chunk that its owner published in the 1-bit form (:meth:`_publish`)
        with the owner's layout ``lay`` into ``dests`` (pieces of the bucket's elements from
        ``a0``, as :func:`_pieces` gives)."""
        per = lay.n
        form = _compressed_form(published, lay)
        assert form is not None, "published in a form that fits (_publish checked it)"
        sscales, signs = form
        # the chunk's padding (and any destination the codec cannot write in place) goes
        # to a scratch chunk
        if self._pad is None or self._pad.numel() < per:  # one for all: the largest chunk's
            self._pad = torch.empty(per, dtype=torch.float32)
        pad = self._pad[:per]
        direct: list[tuple[int, torch.Tensor]] = []
        copied: list[tuple[int, int, torch.Tensor]] = []
        for a, b, d in dests:
            if d.dtype == torch.float32 and d.is_contiguous():
                direct.append((a - a0, d))
            else:
                copied.append((a, b, d))
        codec_for(published.device).rebuild(signs, sscales, lay, pad, direct)
        for a, b, d in copied:
            d.copy_(pad[a - a0 : b - a0])

    def _socket_steps(
        self, key: Hashable, flat: torch.Tensor, shapes: Sequence[torch.Size] | None = None
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
        segments = self._segments(key, shapes, n, per)[self.local_rank]
        outcome = yield from self._inner_chunk(key, mine, {}, segments)
        if (yield from self._agree(key, outcome))[0] != _OK:
            return nan_result(flat)  # skipped on every rank, as a flat reduction
        yield [comm.all_gather(chunks, mine.clone(), group=self.local_group, async_op=True)]
        flat.copy_(buf[:n])
        return flat

    def step_end_steps(self, group: Any, device: torch.device) -> Steps | None:
        return self.inner.step_end_steps(group, device)  # e.g. an Auto's decision

    def statistics(self) -> dict[str, Any]:
        return {**self.inner.statistics(), "hierarchy": {"hosts": self.hosts, "local": self.local}}

    def step_skipped(self) -> bool:
        return self.inner.step_skipped()  # _agree marked the inner one on every rank

    def begin_step(self) -> None:
        self.inner.begin_step()

    def end_step(self) -> None:
        self.inner.end_step()

    def wire_bytes(
        self, flat: torch.Tensor, group: Any = None, shapes: Sequence[torch.Size] | None = None
    ) -> int:
        """What crosses the slow link per rank: the inner compressor's bytes for one chunk
        (as a run of elements: ``shapes`` are not carried to the chunk)."""
        chunk = flat.new_empty(-(-flat.numel() // self.local))
        return self.inner.wire_bytes(chunk, self.cross_group)

    def reset(self) -> None:
        self.state.clear()  # the shared regions are unmapped with their tensors
        self._nonfinite.clear()
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
