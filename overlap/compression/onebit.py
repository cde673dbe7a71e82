"""DeepSpeed's two-phase 1-bit compressed allreduce (DESIGN.md §4), exact and portable.

For a buffer of n elements on each of W ranks, padded with zeros to P (a multiple of 8W,
:func:`padded_numel`), with a worker error e (P floats) and a server error s (P/W floats)
per rank carried across calls:

1. worker: b = x + e; scale = ||b|| / sqrt(P); e <- b - scale * sign(b); pack sign(b)
2. phase 1: all_to_all the W sign chunks, each with the sender's worker scales
3. server (rank j owns chunk j): c = sum_r sign_rj * scale_r / W + s_j;
   sscale = ||c|| / sqrt(P/W); s_j <- c - sscale * sign(c); pack sign(c)
4. phase 2: all_gather the server sign chunks, each with its server scales
5. result chunk j = sscale_j * sign_j, padding dropped, in the buffer's shape and dtype.

sign(v) is +1 for v >= 0 (zero included), -1 otherwise. All arithmetic is float32 whatever
the buffer's dtype, and every rank ends with bitwise-identical results (each value is
computed once, by one rank, and sent). Sums over ranks run in rank order.

Non-finite input: the worker scale is NaN/Inf exactly when b holds NaN/Inf, and phase 1
gives every rank every scale, so all ranks learn it together with no extra collective. The
worker-error update is held back until then: on a non-finite input every rank raises
:class:`~overlap.errors.NonFiniteError` with the buffer and both error states untouched.

Transport: one collective per phase. A chunk's sign bytes and its sender's scales travel as
one row (chunk/8 + 4 x segments bytes), so phase 1 is one all_to_all_single (on the MPI
backend DeepSpeed's MpiBackend pattern, one gather per root) and phase 2 one
all_gather_into_tensor. With two collectives per phase (signs, then scales) a blocking call
on a 4096-float buffer took 3.8 ms on gloo, 2 ranks on the 2-core development machine; with
one, and the rows made once per state, 2.5 ms. The extra copies are 1/32 of a pass.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from overlap import comm
from overlap.argcheck import count
from overlap.comm import driver
from overlap.comm.handle import Handle
from overlap.comm.steps import Steps, run
from overlap.compression.base import Compressor
from overlap.compression.codec import (
    Codec,
    ErrorFeedback,
    codec_for,
    gather_sources,
    write_outputs,
)
from overlap.compression.layout import Layout, layout, padded_numel
from overlap.compression.nonfinite import SkipsNonFinite, nan_result
from overlap.errors import NonFiniteError

__all__ = ["OneBit", "compressed_allreduce", "compressed_bytes", "onebit_steps", "padded_numel"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def compressed_bytes(n: int, world_size: int) -> int:
    """Bytes one rank sends for one compressed_allreduce of n elements.

    Sign chunks to the W-1 other ranks in each phase, plus a 4-byte scale to each of them in
    each phase: 2 (W-1)/W P/8 + 8 (W-1). An fp32 ring allreduce sends 2 (W-1)/W 4n.
    """
    P = padded_numel(n, world_size)
    w = world_size
    return 2 * (w - 1) * (P // 8) // w + 8 * (w - 1)


def _check(buffer: Any, worker_error: Any, server_error: Any, w: int) -> tuple[int, int]:
    for name, t in (
        ("buffer", buffer),
        ("worker_error", worker_error),
        ("server_error", server_error),
    ):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise ValueError(f"{name} is not contiguous; pass {name}.contiguous()")
    if buffer.dtype not in _DTYPES:
        raise TypeError(
            f"compressed_allreduce takes float32, float16 or bfloat16 buffers, got {buffer.dtype}"
        )
    n = buffer.numel()
    P = padded_numel(n, w)
    for name, t, want in (
        ("worker_error", worker_error, P),
        ("server_error", server_error, P // w),
    ):
        if t.dtype != torch.float32 or t.numel() != want:
            raise ValueError(
                f"{name} must be a float32 tensor of {want} elements for a buffer of {n} "
                f"elements on {w} ranks (got {t.dtype} with {t.numel()}); create it with "
                f"torch.zeros(overlap.compression.padded_numel({n}, {w})"
                + (f" // {w}" if name == "server_error" else "")
                + ")"
            )
        if t.device != buffer.device:
            raise ValueError(f"{name} is on {t.device} but buffer is on {buffer.device}")
    return n, P


Publish = Callable[[torch.Tensor, torch.Tensor, Layout], bool]
"""``publish(signs, sscales, lay)``: the reduced result in its compressed form (every chunk's
packed signs, P/8 bytes, and the server scales, (W, segments) float32), offered before it
is rebuilt. True: the callee took it (it copies what it needs: both are scratch reused by
the next call on the state) and will rebuild it itself with :meth:`Codec.rebuild`; the
buffer is left as it was. False: rebuilt as usual. The hierarchical reduction shares it
with the other ranks of a host, so that each rebuilds the whole bucket straight into its
gradients (overlap.scheduler.hierarchy)."""

_THREAD = threading.local()  # the blocking raw API's scratch buffers, per thread


def _finite_rows(scales: torch.Tensor) -> list[bool]:
    """Which ranks' scales are all finite: one host read for all of them (numpy on the
    CPU: a torch isfinite/all/tolist chain costs tens of microseconds per bucket)."""
    if scales.device.type == "cpu":
        rows: list[bool] = np.isfinite(scales.numpy()).all(axis=1).tolist()
        return rows
    ok: list[bool] = torch.isfinite(scales).all(dim=1).tolist()
    return ok


class _Messages:
    """One state's message rows for both phases, and every view of them, made once.

    A row is a chunk's chunk/8 sign bytes followed by its sender's scales (4 x segments
    bytes). Kept on the :class:`ErrorFeedback` (calls on one state run one after the
    other), so a call does copies into ready views and no tensor slicing."""

    def __init__(self, lay: Layout, dev: torch.device) -> None:
        w, cb, sb = lay.w, lay.chunk // 8, 4 * lay.nseg
        self.key = self.key_of(lay, dev)
        self.cb, self.sb = cb, sb
        row = cb + sb

        def u8(numel: int) -> torch.Tensor:
            return torch.empty(numel, dtype=torch.uint8, device=dev)

        def f32(shape: tuple[int, int]) -> torch.Tensor:
            return torch.empty(shape, dtype=torch.float32, device=dev)

        self.send, self.recv, self.mine, self.rows = u8(w * row), u8(w * row), u8(row), u8(w * row)
        send, recv, rows = self.send.view(w, row), self.recv.view(w, row), self.rows.view(w, row)
        self.send_signs, self.send_scales = send[:, :cb], send[:, cb:]
        self.recv_rows, self.recv_scales = recv, recv[:, cb:]
        self.mine_signs, self.mine_scales = self.mine[:cb], self.mine[cb:]
        self.rows_signs, self.rows_scales = rows[:, :cb], rows[:, cb:]
        self.scales, self.sscales = f32((w, lay.nseg)), f32((w, lay.nseg))
        self.scales_bytes, self.sscales_bytes = (
            self.scales.view(torch.uint8),
            self.sscales.view(torch.uint8),
        )
        self.all_signs = u8(lay.P // 8)
        self.all_signs_rows = self.all_signs.view(w, cb)

    @staticmethod
    def key_of(lay: Layout, dev: torch.device) -> tuple[Any, ...]:
        """What the rows' sizes depend on: rows made for another key are made again."""
        return (lay.P, lay.w, lay.nseg, dev)


def _messages(ef: ErrorFeedback, lay: Layout, dev: torch.device) -> _Messages:
    m: _Messages | None = ef.cache.get("messages")
    if m is None or m.key != _Messages.key_of(lay, dev):
        m = ef.cache["messages"] = _Messages(lay, dev)
    return m


def onebit_steps(
    buffer: torch.Tensor,
    ef: ErrorFeedback,
    lay: Layout,
    codec: Codec,
    group: Any = None,
    direct: Sequence[tuple[int, torch.Tensor]] = (),
    read_direct: bool = False,
    publish: Publish | None = None,
    inputs: Sequence[tuple[int, torch.Tensor]] | None = None,
    mean_with: torch.Tensor | None = None,
) -> Steps:
    """The algorithm as a steps generator (see overlap.comm.steps), written once; the
    arithmetic of each phase is the ``codec``'s. ``ef`` is the buffer's error feedback (lazy
    form, :class:`~overlap.compression.codec.ErrorFeedback`), ``lay`` its :class:`Layout`;
    ``direct`` as in :meth:`Codec.rebuild`; ``read_direct``: the ``direct`` tensors also
    hold the input for their elements (``buffer``'s copy of them is stale), read by
    :meth:`Codec.encode` as its ``sources``. ``publish``: see :data:`Publish`; when it takes
    the result, nothing is rebuilt here. ``inputs`` (instead of ``direct`` with
    ``read_direct``) and ``mean_with``: :meth:`Codec.encode`'s ``sources`` and
    ``mean_with``."""
    n, w, me = lay.n, lay.w, lay.me
    if n == 0:
        return buffer
    dev = buffer.device

    # 1. worker side: b = x + e into a spare buffer; the state is committed only once every
    # rank's scales are known finite
    sources = inputs if inputs is not None else direct if read_direct else ()
    packed, scale, b = codec.encode(buffer, lay, ef, sources, mean_with)
    m = _messages(ef, lay, dev)

    # 2. phase 1: sign chunk j to rank j, each with this rank's worker scales in the same
    # message (one collective, not two: per-op cost dominates a bucket's exchange on gloo)
    m.send_signs.copy_(packed.view(w, m.cb))
    m.send_scales.copy_(scale.view(torch.uint8).expand(w, m.sb))
    if comm.get_backend() == "mpi":  # DeepSpeed's MpiBackend: one gather per root
        slots = list(m.recv_rows)
        sent = m.send.view(w, -1)
        hs = [
            comm.gather(
                sent[i],
                slots if i == me else None,
                dst=comm.get_global_rank(group, i),
                group=group,
                async_op=True,
            )
            for i in range(w)
        ]
    else:
        hs = [comm.all_to_all_single(m.recv, m.send, group=group, async_op=True)]
    yield hs

    m.scales_bytes.copy_(m.recv_scales)  # (w, nseg) floats: every rank's worker scales
    bad = [comm.get_global_rank(group, i) for i, ok in enumerate(_finite_rows(m.scales)) if not ok]
    if bad:
        # Phase 2 is still issued (its result unused), so the collectives a rank issues do
        # not depend on the values: under a hierarchical reduction a host's ranks reduce
        # different chunks and only some of them see the NaN, and the host's own
        # collectives are pipelined among the buckets' phases by phase count.
        yield [comm.all_gather_into_tensor(m.rows, m.mine, group=group, async_op=True)]
        raise NonFiniteError(
            f"compressed_allreduce: the input on rank(s) {bad} holds NaN or Inf; the buffer "
            "and the error-feedback state were left unchanged on every rank. Skip this step "
            "(e.g. with loss scaling) or find the source of the non-finite gradient",
            ranks=bad,
        )
    ef.commit_worker(b, scale)

    # 3. server side for the chunk this rank owns (recv's rows: the signs, then the scales)
    spacked, sscale = codec.server(m.recv_rows, m.scales / w, lay, ef)
    ef.ss = sscale = sscale.to(dev)

    # 4. phase 2: everyone gets every server chunk with its scales, again in one message
    m.mine_signs.copy_(spacked)
    m.mine_scales.copy_(sscale.view(torch.uint8))
    yield [comm.all_gather_into_tensor(m.rows, m.mine, group=group, async_op=True)]
    m.all_signs_rows.copy_(m.rows_signs)
    m.sscales_bytes.copy_(m.rows_scales)
    all_signs, sscales = m.all_signs, m.sscales
    if publish is not None and publish(all_signs, sscales, lay):
        return buffer  # the caller rebuilds it (elsewhere, or on other ranks too)

    # 5. rebuild: element i of chunk j is sscale[j, segment(i)] * sign, straight into the
    # buffer when it is float32
    fp32 = buffer.dtype == torch.float32
    out = buffer.reshape(-1) if fp32 else torch.empty(n, dtype=torch.float32, device=dev)
    codec.rebuild(all_signs, sscales, lay, out, direct if fp32 else ())
    if not fp32:
        buffer.copy_(out.view(buffer.shape))
        write_outputs(buffer, direct)
    return buffer


def _raw_steps(
    buffer: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    group: Any,
    segments: Sequence[int] | None,
    reuse: bool = False,
) -> Steps:
    """onebit_steps over caller-held *true* error tensors, updated in place (one extra pass
    each to turn the lazy state back into errors; OneBit keeps the lazy form instead).

    ``reuse`` (blocking calls only: they finish before the thread's next call) takes the
    scratch buffers from a per-thread cache instead of allocating P floats per call."""
    w = comm.get_world_size(group)
    n, _ = _check(buffer, worker_error, server_error, w)
    if n == 0:
        return buffer
    lay = layout(n, w, comm.get_rank(group), segments)
    cached: Any = getattr(_THREAD, "cache", None) if reuse else None
    if cached is not None and (cached[0].numel() != lay.P or cached[0].device != buffer.device):
        cached = None
    ef = ErrorFeedback(worker_error, server_error, lay.nseg, spare=cached and cached[0])
    if cached is not None:
        ef._scratch, ef.cache = cached[1], cached[2]
    out = yield from onebit_steps(buffer, ef, lay, codec_for(buffer.device), group)
    # ef.wb is now the new b; worker_error (the old wb) is the spare: write the error back
    ef.worker_error(lay, out=worker_error)
    ef.server_error(lay, out=server_error)
    if reuse:  # b's buffer is free again: keep it for this thread's next blocking call
        _THREAD.cache = (ef.wb, ef._scratch, ef.cache)
    return out


def compressed_allreduce(
    buffer: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    *,
    group: Any = None,
    async_op: bool = False,
    segments: Sequence[int] | None = None,
) -> Any:
    """Average ``buffer`` across the group with DeepSpeed's 1-bit compression, in place.

    ``worker_error`` (``padded_numel(n, W)`` float32 elements) and ``server_error`` (P/W)
    carry the error feedback between calls and are updated in place; start them at zero.
    Returns the buffer, or with ``async_op=True`` a Handle resolving to it: the reduction
    runs to the end on a driver thread whatever is done with the handle (await it, wait,
    poll, or drop it; :mod:`overlap.comm.driver`).
    Raises NonFiniteError (on every rank, state untouched) if any rank's input holds NaN/Inf.
    ``segments`` (element counts adding up to the buffer's) gives each segment its own scales.
    """
    if not async_op:
        return run(_raw_steps(buffer, worker_error, server_error, group, segments, True))
    w = comm.get_world_size(group)
    _check(buffer, worker_error, server_error, w)  # bad input raises here, not from the handle
    if buffer.numel() == 0:  # nothing to send: done now
        done = Handle("compressed_allreduce", result=buffer, backend=comm.get_backend())
        done._finish(None)
        return done
    handle: Handle = driver.submit(
        "compressed_allreduce",
        lambda twin: _raw_steps(buffer, worker_error, server_error, twin, segments, False),
        group,
        nbytes=compressed_bytes(buffer.numel(), w),
        backend=comm.get_backend(),
        device=buffer.device,
    )
    return handle


class OneBit(SkipsNonFinite, Compressor):
    """The 1-bit compressor: :func:`compressed_allreduce` with error feedback per bucket key.

    ``per_tensor_scales`` (default True): when the caller passes the bucket's tensor shapes,
    each tensor gets its own worker and server scales (still 4 collectives). Measured: a
    2-layer MLP bucket (weights and biases together) under SGD with momentum 0.9, lr 0.01,
    reached loss 0.45 after 150 steps with per-tensor scales and diverged (5.9) with one scale.

    ``warmup_steps``: each key is reduced uncompressed (a plain averaging allreduce) for its
    first K calls, like PowerSGD's start iteration; 1-bit compression of raw gradients can
    diverge early in training where plain averaging converges (measured: 2-layer MLP, SGD with
    momentum 0.9, lr 0.05 diverged, lr 0.01 converged). ``on_nonfinite``: ``"raise"`` (the
    default) raises NonFiniteError on every rank; ``"skip"`` makes the result NaN on every
    rank, counts the step in ``skipped_steps`` and sets ``last_skipped`` (for every bucket
    of the step), so a loss scaler or the caller skips the optimizer step on every rank
    alike (:mod:`overlap.compression.nonfinite`). Either way no error-feedback state is
    touched.
    """

    name = "onebit"
    summable = False
    writes_outputs = True
    reads_outputs = True

    def __init__(
        self, warmup_steps: int = 0, on_nonfinite: str = "raise", per_tensor_scales: bool = True
    ) -> None:
        warmup_steps = count("warmup_steps", warmup_steps, 0)
        self._init_nonfinite(on_nonfinite)
        self.warmup_steps = warmup_steps
        self.per_tensor_scales = per_tensor_scales
        self.state: dict[Any, dict[str, Any]] = {}
        self._world: int | None = None
        # Compile the CPU kernels now (or load them from numba's cache): a compile inside
        # the first compressed step would stall training by a second or more.
        codec_for(torch.device("cpu"))

    def __repr__(self) -> str:
        return (
            f"OneBit(warmup_steps={self.warmup_steps}, on_nonfinite={self.on_nonfinite!r}, "
            f"per_tensor_scales={self.per_tensor_scales})"
        )

    def _entry(self, key: Any, flat: torch.Tensor) -> dict[str, Any]:
        st = self.state.get(key)
        n = flat.numel()
        if st is None:
            st = self.state[key] = {"step": 0, "numel": n, "ef": None, "lay": None}
        elif st["numel"] != n:
            raise ValueError(
                f"bucket {key!r} had {st['numel']} elements when its state was made but has "
                f"{n} now: the model or the bucket layout changed; start a fresh OneBit"
            )
        return st

    def _state_for(
        self, st: dict[str, Any], flat: torch.Tensor, group: Any, shapes: Any
    ) -> tuple[ErrorFeedback, Layout]:
        """The entry's error feedback and layout, created (or converted from loaded errors)
        on first compressed use."""
        w = comm.get_world_size(group)
        segments = (
            [int(torch.Size(x).numel()) for x in shapes]
            if self.per_tensor_scales and shapes
            else None
        )
        lay = layout(flat.numel(), w, comm.get_rank(group), segments)
        old = st["lay"]
        if old is not None and old is not lay and old.seg_len.tolist() != lay.seg_len.tolist():
            raise ValueError(
                "this bucket's tensor shapes changed since its 1-bit state was made: the "
                "per-tensor scales no longer apply; start a fresh OneBit"
            )
        st["lay"] = lay
        ef = st["ef"]
        if ef is None:
            ef = st["ef"] = ErrorFeedback.zeros(lay, flat.device)
        elif isinstance(ef, tuple):  # true errors from load_state_dict
            we, se = ef
            ef = st["ef"] = ErrorFeedback(we.to(flat.device), se.to(flat.device), lay.nseg)
        return ef, lay

    def reduce_steps(
        self,
        key: Any,
        flat: torch.Tensor,
        *,
        group: Any = None,
        shapes: Any = None,
        outputs: Sequence[tuple[int, torch.Tensor]] = (),
        read_outputs: bool = False,
        publish: Publish | None = None,
        inputs: Sequence[tuple[int, torch.Tensor]] = (),
        mean_with: torch.Tensor | None = None,
    ) -> Steps:
        """``read_outputs`` (see :meth:`Compressor.reduce_steps`): the encode stage reads
        each output tensor that is one of the layout's segments in place; the others, and
        the warm-up's uncompressed allreduce, take a copy into ``flat`` first. ``publish``
        (:data:`Publish`) is offered a compressed result; a warm-up step has none.

        ``inputs`` ((start, tensor) pairs, read as ``read_outputs`` reads the outputs) and
        ``mean_with`` (float32, ``flat``'s size; needs a float32 ``flat``): the input is the
        elementwise mean of ``flat`` with ``inputs`` over it and ``mean_with``, taken inside
        the encode pass (a warm-up step first writes it into ``flat``). A hierarchical
        host of two ranks averages its chunk this way. With either, a skipped (non-finite)
        step writes nothing to the outputs."""
        w = comm.get_world_size(group)
        self._check_world(w)
        st = self._entry(key, flat)
        fused = bool(inputs) or mean_with is not None
        if mean_with is not None and not (
            flat.dtype == mean_with.dtype == torch.float32 and mean_with.numel() == flat.numel()
        ):
            raise ValueError(
                "mean_with must be a float32 tensor of the buffer's size, with a float32 "
                f"buffer; got {mean_with.dtype} x {mean_with.numel()} for {flat.dtype} x "
                f"{flat.numel()}"
            )
        if st["step"] < self.warmup_steps:
            if read_outputs:
                gather_sources(flat, outputs)
            if fused:
                gather_sources(flat, inputs)
                if mean_with is not None:
                    flat.add_(mean_with.view(flat.shape)).mul_(0.5)
            self.prepare(key, flat, group, shapes)
            yield [comm.all_reduce(flat, op="avg", group=group, async_op=True)]
            st["step"] += 1
            write_outputs(flat, outputs)
            return flat
        if flat.numel() == 0:
            return flat
        ef, lay = self._state_for(st, flat, group, shapes)
        try:
            yield from onebit_steps(
                flat,
                ef,
                lay,
                codec_for(flat.device),
                group,
                outputs,
                read_outputs,
                publish,
                inputs if fused else None,
                mean_with,
            )
        except NonFiniteError as exc:
            self._nonfinite(exc)  # raises, or counts the skip: the result is NaN
            # fused: the caller (a hierarchical host) fills its own
            return flat if fused else nan_result(flat, outputs)
        st["step"] += 1
        return flat

    def prepare(self, key: Any, flat: torch.Tensor, group: Any = None, shapes: Any = None) -> None:
        """Allocate (and touch) ``key``'s error-feedback state, 2.5 P floats, now: its page
        faults then fall in a warm-up step, not in the first compressed one (measured: a
        1.1 s first compressed step at 25M parameters without it)."""
        self._check_world(comm.get_world_size(group))
        if flat.numel():
            self._state_for(self._entry(key, flat), flat, group, shapes)[0].take_spare()

    def wire_bytes(
        self, flat: torch.Tensor, group: Any = None, shapes: Sequence[torch.Size] | None = None
    ) -> int:
        return compressed_bytes(flat.numel(), comm.get_world_size(group))

    def _check_world(self, w: int) -> None:
        if self._world is None:
            self._world = w
        elif self._world != w:
            raise ValueError(
                f"this OneBit's state is for {self._world} ranks but its group has {w}: its "
                "error feedback is laid out per rank; resume on the same number of ranks or "
                "use a fresh OneBit"
            )

    def state_dict(self) -> dict[str, Any]:
        """Per bucket: the step and the *true* worker and server errors (DESIGN.md section 4),
        materialized from the lazy state, so a checkpoint does not depend on it."""

        def errors(v: dict[str, Any]) -> tuple[Any, Any]:
            ef = v["ef"]
            if ef is None:
                return None, None
            if isinstance(ef, tuple):
                return ef[0].detach().clone(), ef[1].detach().clone()
            return ef.worker_error(v["lay"]), ef.server_error(v["lay"])

        out: dict[str, Any] = {}
        for k, v in self.state.items():
            we, se = errors(v)
            out[k] = {
                "step": v["step"],
                "numel": v["numel"],
                "worker_error": we,
                "server_error": se,
            }
        return {
            "name": self.name,
            "world_size": self._world,
            "per_tensor_scales": self.per_tensor_scales,
            "warmup_steps": self.warmup_steps,
            "skipped_steps": self.skipped_steps,
            "state": out,
        }

    def check_state(self, state: dict[str, Any]) -> None:
        """Refuse a state of another compressor, another ``per_tensor_scales``, another
        world size than this OneBit already runs on, or with error buffers that do not fit."""
        if state.get("name") != self.name:
            raise ValueError(
                f"this state is for the {state.get('name')!r} compressor, not 'onebit'"
            )
        saved_pts = state.get("per_tensor_scales")
        if saved_pts is not None and bool(saved_pts) != self.per_tensor_scales:
            raise ValueError(
                f"this OneBit state was saved with per_tensor_scales={bool(saved_pts)} but this "
                f"OneBit has per_tensor_scales={self.per_tensor_scales}: its error feedback is "
                f"laid out for the other; build OneBit(per_tensor_scales={bool(saved_pts)})"
            )
        saved_w = state.get("world_size")
        if saved_w is not None and self._world is not None and saved_w != self._world:
            raise ValueError(
                f"this OneBit state was saved on {saved_w} ranks but this OneBit runs on "
                f"{self._world}: error-feedback buffers are laid out per rank and cannot be "
                "resharded; resume on the same number of ranks or start a fresh OneBit"
            )
        for k, v in state["state"].items():
            if v["worker_error"] is not None and saved_w:
                P = padded_numel(v["numel"], saved_w)
                if v["worker_error"].numel() != P or v["server_error"].numel() != P // saved_w:
                    raise ValueError(
                        f"bucket {k!r}: error buffers do not match {v['numel']} "
                        f"elements on {saved_w} ranks; the state is corrupt"
                    )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. The world size is checked against the group at the
        first reduction (a OneBit does not know its group before), not against the world."""
        self.check_state(state)
        saved_w = state.get("world_size")
        self._world = saved_w
        self.warmup_steps = int(state.get("warmup_steps", self.warmup_steps))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.state = {
            k: {
                "step": v["step"],
                "numel": v["numel"],
                "ef": None
                if v["worker_error"] is None
                else (v["worker_error"].clone(), v["server_error"].clone()),
                "lay": None,
            }
            for k, v in state["state"].items()
        }
