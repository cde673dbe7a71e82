"""DeepSpeed's two-phase 1-bit compressed allreduce (DESIGN.md §4), exact and portable.

For a buffer of n elements on each of W ranks, padded with zeros to P (a multiple of 8W,
:func:`padded_numel`), with a worker error e (P floats) and a server error s (P/W floats)
per rank carried across calls:

1. worker: b = x + e; scale = ||b|| / sqrt(P); e <- b - scale * sign(b); pack sign(b)
2. phase 1: all_to_all the W sign chunks, all_gather the W worker scales
3. server (rank j owns chunk j): c = sum_r sign_rj * scale_r / W + s_j;
   sscale = ||c|| / sqrt(P/W); s_j <- c - sscale * sign(c); pack sign(c)
4. phase 2: all_gather the server sign chunks and scales
5. result chunk j = sscale_j * sign_j, padding dropped, in the buffer's shape and dtype.

sign(v) is +1 for v >= 0 (zero included), -1 otherwise. All arithmetic is float32 whatever
the buffer's dtype, and every rank ends with bitwise-identical results (each value is
computed once, by one rank, and sent). Sums over ranks run in rank order.

Non-finite input: the worker scale is NaN/Inf exactly when b holds NaN/Inf, and phase 1
gives every rank every scale, so all ranks learn it together with no extra collective. The
worker-error update is held back until then: on a non-finite input every rank raises
:class:`~overlap.errors.NonFiniteError` with the buffer and both error states untouched.

Transport: on torch.distributed, all_to_all_single + all_gather_into_tensor; on the MPI
backend, DeepSpeed's MpiBackend pattern, one gather per root for the sign chunks, then
allgathers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from overlap import comm
from overlap.comm.handle import Handle
from overlap.comm.steps import Steps, run, steps_handle
from overlap.compression import fused
from overlap.compression.base import Compressor
from overlap.compression.packbits import pack_signs, sign_table
from overlap.errors import NonFiniteError

__all__ = ["OneBit", "compressed_allreduce", "compressed_bytes", "onebit_steps", "padded_numel"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def padded_numel(n: int, world_size: int) -> int:
    """P: ``n`` rounded up to a multiple of 8 x ``world_size`` (0 stays 0)."""
    if n < 0 or world_size < 1:
        raise ValueError(f"padded_numel needs n >= 0 and world_size >= 1, got {n}, {world_size}")
    m = 8 * world_size
    return -(-n // m) * m


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


def _minus_signed(v: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """out = v - scale * sign(v), sign(v) = +1 for v >= 0.

    ``copysign`` measured 3.5x faster than ``torch.where`` here (40 vs 141 ms for 16M floats).
    It differs from ``v >= 0`` only at -0.0, which cannot occur: errors start at +0 and every
    update rounds to +0 (x - x is +0), so ``x + e`` is -0.0 only if both are.
    """
    torch.sub(v, torch.copysign(scale.expand_as(v) if scale.dim() == 0 else scale, v), out=out)


def _pieces(segments: Sequence[int], n: int, P: int, w: int) -> Any:
    """Segment boundaries (the padding is its own last segment) and their pieces per chunk.

    Returns (bounds, pieces): bounds[k] = (start, end) of segment k; pieces is a list of
    (start, end, segment, chunk) covering [0, P) in order.
    """
    if sum(segments) != n or any(k < 0 for k in segments):
        raise ValueError(
            f"segments {list(segments)} must be non-negative and add up to the "
            f"buffer's {n} elements"
        )
    lengths = [*segments, P - n]
    bounds, off = [], 0
    for k in lengths:
        bounds.append((off, off + k))
        off += k
    chunk = P // w
    pieces = []
    for k, (a, e) in enumerate(bounds):
        cur = a
        while cur < e:
            j = cur // chunk
            stop = min(e, (j + 1) * chunk)
            pieces.append((cur, stop, k, j))
            cur = stop
    return bounds, pieces


def _rms(
    v: torch.Tensor, ranges: Sequence[tuple[int, int]], count: int, index: Sequence[int]
) -> torch.Tensor:
    """Per range: ||v[a:e]|| / sqrt(e - a), placed at ``index`` in a vector of ``count``."""
    out = torch.zeros(count, dtype=torch.float32, device=v.device)
    for (a, e), k in zip(ranges, index, strict=True):
        if e > a:
            out[k] = torch.linalg.vector_norm(v[a:e]) / math.sqrt(e - a)
    return out


def _segmented_update(
    v: torch.Tensor,
    ranges: Sequence[tuple[int, int]],
    scales: torch.Tensor,
    index: Sequence[int],
    out: torch.Tensor,
    fast: bool,
) -> None:
    if fast:
        import numpy as np

        starts = np.array([a for a, _ in ranges], dtype=np.int64)
        ends = np.array([e for _, e in ranges], dtype=np.int64)
        sc = scales[list(index)].numpy() if len(index) else np.zeros(0, dtype=np.float32)
        fused.kernel("update_ranges")(v.numpy(), starts, ends, sc, out.numpy())
        return
    for (a, e), k in zip(ranges, index, strict=True):
        if e > a:
            _minus_signed(v[a:e], scales[k], out[a:e])


class _SegIndex:
    """Per-element segment indices for the vectorised (CUDA) path, built once per layout.

    On a GPU the per-segment loops of the CPU path launch a few kernels per tensor of a bucket
    (hundreds per bucket), so the codec is launch-bound. Here each segmented step is a fixed
    number of kernels: per-segment sums of squares with ``segment_reduce`` over the contiguous
    ranges (deterministic, unlike an atomic ``index_add``), and per-element scales by a gather.
    """

    def __init__(self, seg: Any, P: int, w: int, me: int, dev: torch.device) -> None:
        bounds, pieces = seg
        chunk = P // w
        self.nseg = len(bounds)
        self.lengths = torch.tensor([e - a for a, e in bounds], dtype=torch.int64, device=dev)
        seg_id = torch.repeat_interleave(
            torch.arange(self.nseg, device=dev), self.lengths, output_size=P
        )
        self.seg_id = seg_id
        # rebuild: element i of chunk j takes sscale[j, segment(i)]
        self.rebuild = (torch.arange(P, device=dev) // chunk) * self.nseg + seg_id
        mine = [(a, e, k) for a, e, k, j in pieces if j == me]
        self.local_lengths = torch.tensor(
            [e - a for a, e, _ in mine], dtype=torch.int64, device=dev
        )
        self.local_ks = torch.tensor([k for _, _, k in mine], dtype=torch.int64, device=dev)
        self.local_id = seg_id[me * chunk : (me + 1) * chunk]


_SEG_CACHE: dict[tuple[Any, ...], _SegIndex] = {}
# Devices that take the vectorised segmented path. CPU keeps the per-segment path (numba's
# fused kernels, or torch ops bitwise equal to them); tests add "cpu" to compare the two.
VECTOR_DEVICES: set[str] = {"cuda"}


def _seg_index(
    segments: Sequence[int], seg: Any, P: int, w: int, me: int, dev: torch.device
) -> _SegIndex:
    key = (tuple(segments), P, w, me, str(dev))
    idx = _SEG_CACHE.get(key)
    if idx is None:
        if len(_SEG_CACHE) > 256:
            _SEG_CACHE.clear()
        idx = _SEG_CACHE[key] = _SegIndex(seg, P, w, me, dev)
    return idx


def _seg_rms(v: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """sqrt(mean(v**2)) per contiguous segment (0 for an empty one)."""
    sq = torch.segment_reduce(v * v, "sum", lengths=lengths)
    return torch.sqrt(sq / lengths.clamp(min=1).to(v.dtype))


def _finite_rows(scales: torch.Tensor) -> list[bool]:
    """Which ranks' scales are all finite: one host read for all of them."""
    ok: list[bool] = torch.isfinite(scales).all(dim=1).tolist()
    return ok


def onebit_steps(
    buffer: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    group: Any = None,
    segments: Sequence[int] | None = None,
) -> Steps:
    """The algorithm as a steps generator (see overlap.comm.steps).

    ``segments`` (lengths adding up to the buffer's numel) gives each segment, typically each
    tensor of a bucket, its own worker and server scales; the padding gets one of its own.
    With one segment (or None) this is exactly DESIGN.md section 4.
    """
    w = comm.get_world_size(group)
    n, P = _check(buffer, worker_error, server_error, w)
    if n == 0:
        return buffer
    chunk = P // w
    dev = buffer.device
    ranks = [comm.get_global_rank(group, i) for i in range(w)]
    me = comm.get_rank(group)
    seg = None
    if segments is not None and len(segments) > 1:
        seg = _pieces(segments, n, P, w)
    nseg = 1 if seg is None else len(seg[0])
    sx = None  # the vectorised segment index, on the devices that use it
    if seg is not None and segments is not None and dev.type in VECTOR_DEVICES:
        sx = _seg_index(segments, seg, P, w, me, dev)

    # 1. worker side (the worker error is committed only once every scale is known finite)
    b = torch.empty(P, dtype=torch.float32, device=dev)
    torch.add(buffer.reshape(-1), worker_error[:n], out=b[:n])  # one pass: copy and add fused
    b[n:].copy_(worker_error[n:])
    fast = dev.type == "cpu" and fused.available()
    if seg is None:
        scale = (torch.linalg.vector_norm(b) / math.sqrt(P)).reshape(1)
    elif sx is not None:
        scale = _seg_rms(b, sx.lengths)
    else:
        scale = _rms(b, seg[0], nseg, range(nseg))
    if fast:
        packed = torch.empty(P // 8, dtype=torch.uint8)
        fused.pack_signs_np(b.numpy(), packed.numpy())
    else:
        packed = pack_signs(b)

    # 2. phase 1: sign chunk j to rank j; every worker scale to everyone
    recv = torch.empty(P // 8, dtype=torch.uint8, device=dev)
    scales = torch.empty(w * nseg, dtype=torch.float32, device=dev)
    if comm.get_backend() == "mpi":  # DeepSpeed's MpiBackend: one gather per root
        sent = packed.view(w, -1)
        slots = list(recv.view(w, -1))
        hs = [
            comm.gather(
                sent[i], slots if i == me else None, dst=ranks[i], group=group, async_op=True
            )
            for i in range(w)
        ]
    else:
        hs = [comm.all_to_all_single(recv, packed, group=group, async_op=True)]
    hs.append(comm.all_gather_into_tensor(scales, scale, group=group, async_op=True))
    yield hs

    scales2 = scales.view(w, nseg)
    bad = [ranks[i] for i, ok in enumerate(_finite_rows(scales2)) if not ok]
    if bad:
        raise NonFiniteError(
            f"compressed_allreduce: the input on rank(s) {bad} holds NaN or Inf; the buffer "
            "and the error-feedback state were left unchanged on every rank. Skip this step "
            "(e.g. with loss scaling) or find the source of the non-finite gradient",
            ranks=bad,
        )
    if sx is not None:
        _minus_signed(b, scale[sx.seg_id], worker_error)
    elif seg is not None:
        _segmented_update(b, seg[0], scale, range(nseg), worker_error, fast)
    elif fast:
        fused.error_update(b.numpy(), float(scale[0]), worker_error.numpy())
    else:
        _minus_signed(b, scale[0], worker_error)

    # 3. server side for the chunk this rank owns
    table = sign_table(dev)
    c = torch.zeros(chunk, dtype=torch.float32, device=dev)
    base = me * chunk
    if sx is not None:
        # c = sum over ranks r (in order) of sign_r * scale_r[segment] / W, plus the error
        q = scales2 / w
        sgn = table[recv.view(w, -1).long()].reshape(w, chunk)
        for r in range(w):
            c.addcmul_(sgn[r], q[r][sx.local_id])
        c.add_(server_error)
        sscale = torch.zeros(nseg, dtype=torch.float32, device=dev)
        sscale[sx.local_ks] = _seg_rms(c, sx.local_lengths)
        _minus_signed(c, sscale[sx.local_id], server_error)
    elif seg is not None:
        mine = [(a - base, e - base, k) for a, e, k, j in seg[1] if j == me]
        local = [(a, e) for a, e, _ in mine]
        ks = [k for _, _, k in mine]
        q = scales2 / w
        if fast:
            import numpy as np

            fused.kernel("server_ranges")(
                recv.view(w, -1).numpy(),
                q.numpy(),
                np.array([a for a, _ in local], dtype=np.int64),
                np.array([e for _, e in local], dtype=np.int64),
                np.array(ks, dtype=np.int64),
                server_error.numpy(),
                c.numpy(),
            )
        else:
            signs_r = [table[p].reshape(-1) for p in recv.view(w, -1).long()]
            for (a, e), k in zip(local, ks, strict=True):
                for r in range(w):
                    c[a:e].add_(signs_r[r][a:e] * q[r, k])
            c.add_(server_error)
        sscale = _rms(c, local, nseg, ks)
        _segmented_update(c, local, sscale, ks, server_error, fast)
    elif fast:
        qn = (scales / w).numpy()
        fused.server_accumulate(recv.view(w, -1).numpy(), qn, server_error.numpy(), c.numpy())
        sscale = (torch.linalg.vector_norm(c) / math.sqrt(chunk)).reshape(1)
        fused.error_update(c.numpy(), float(sscale[0]), server_error.numpy())
    else:
        parts = recv.view(w, -1).long()
        for r in range(w):
            c.add_((table * (scales[r] / w))[parts[r]].reshape(-1))
        c.add_(server_error)
        sscale = (torch.linalg.vector_norm(c) / math.sqrt(chunk)).reshape(1)
        _minus_signed(c, sscale[0], server_error)
    if fast:
        spacked = torch.empty(chunk // 8, dtype=torch.uint8)
        fused.pack_signs_np(c.numpy(), spacked.numpy())
    else:
        spacked = pack_signs(c)

    # 4. phase 2: everyone gets every server chunk and scale
    all_signs = torch.empty(P // 8, dtype=torch.uint8, device=dev)
    sscales = torch.empty(w * nseg, dtype=torch.float32, device=dev)
    yield [
        comm.all_gather_into_tensor(all_signs, spacked, group=group, async_op=True),
        comm.all_gather_into_tensor(sscales, sscale, group=group, async_op=True),
    ]

    # 5. rebuild: element i of chunk j is sscale[j, segment(i)] * sign
    direct = buffer.dtype == torch.float32
    if fast:
        dst = buffer.detach().reshape(-1) if direct else torch.empty(n, dtype=torch.float32)
        if seg is None:
            fused.rebuild(all_signs.numpy(), sscales.numpy(), chunk // 8, n, dst.numpy())
        else:
            import numpy as np

            pcs = [(a, min(e, n), k, j) for a, e, k, j in seg[1] if a < n]
            fused.kernel("rebuild_ranges")(
                all_signs.numpy(),
                sscales.view(w, nseg).numpy(),
                np.array([p[0] for p in pcs], dtype=np.int64),
                np.array([p[1] for p in pcs], dtype=np.int64),
                np.array([p[3] for p in pcs], dtype=np.int64),
                np.array([p[2] for p in pcs], dtype=np.int64),
                dst.numpy(),
            )
        if not direct:
            buffer.copy_(dst.reshape(buffer.shape))
        return buffer
    signs = table[all_signs.long()].reshape(-1)
    if seg is None:
        out = signs.reshape(w, chunk) * sscales.reshape(w, 1)
    elif sx is not None:
        out = signs * sscales[sx.rebuild]
    else:
        ss = sscales.view(w, nseg)
        out = torch.empty(P, dtype=torch.float32, device=dev)
        for a, e, k, j in seg[1]:
            out[a:e] = signs[a:e] * ss[j, k]
    buffer.copy_(out.reshape(-1)[:n].reshape(buffer.shape))
    return buffer


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
    Returns the buffer, or with ``async_op=True`` a Handle resolving to it (await it, or
    ``wait()``: phase 1 is issued now, phase 2 when the handle is first waited or awaited).
    Raises NonFiniteError (on every rank, state untouched) if any rank's input holds NaN/Inf.
    ``segments`` (element counts adding up to the buffer's) gives each segment its own scales.
    """
    steps = onebit_steps(buffer, worker_error, server_error, group, segments)
    if not async_op:
        return run(steps)
    w = comm.get_world_size(group)
    handle: Handle = steps_handle(
        "compressed_allreduce",
        steps,
        nbytes=compressed_bytes(buffer.numel(), w),
        backend=comm.get_backend(),
    )
    return handle


class OneBit(Compressor):
    """The 1-bit compressor: :func:`compressed_allreduce` with error feedback per bucket key.

    ``per_tensor_scales`` (default True): when the caller passes the bucket's tensor shapes,
    each tensor gets its own worker and server scales (still 4 collectives). Measured: a
    2-layer MLP bucket (weights and biases together) under SGD with momentum 0.9, lr 0.01,
    reached loss 0.45 after 150 steps with per-tensor scales and diverged (5.9) with one scale.

    ``warmup_steps``: each key is reduced uncompressed (a plain averaging allreduce) for its
    first K calls, like PowerSGD's start iteration; 1-bit compression of raw gradients can
    diverge early in training where plain averaging converges (measured: 2-layer MLP, SGD with
    momentum 0.9, lr 0.05 diverged, lr 0.01 converged). ``on_nonfinite``: ``"raise"`` (the
    default) raises NonFiniteError on every rank; ``"skip"`` leaves the buffer as it was,
    counts the step in ``skipped_steps`` and sets ``last_skipped``, so the caller can skip the
    optimizer step. Either way no error-feedback state is touched.
    """

    name = "onebit"
    summable = False

    def __init__(
        self, warmup_steps: int = 0, on_nonfinite: str = "raise", per_tensor_scales: bool = True
    ) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if on_nonfinite not in ("raise", "skip"):
            raise ValueError(f"on_nonfinite must be 'raise' or 'skip', got {on_nonfinite!r}")
        self.warmup_steps = warmup_steps
        self.on_nonfinite = on_nonfinite
        self.per_tensor_scales = per_tensor_scales
        self.state: dict[Any, dict[str, Any]] = {}
        self.skipped_steps = 0
        self.last_skipped = False
        self._world: int | None = None

    def __repr__(self) -> str:
        return (
            f"OneBit(warmup_steps={self.warmup_steps}, on_nonfinite={self.on_nonfinite!r}, "
            f"per_tensor_scales={self.per_tensor_scales})"
        )

    def _entry(self, key: Any, flat: torch.Tensor, w: int) -> dict[str, Any]:
        st = self.state.get(key)
        n = flat.numel()
        if st is None:
            st = self.state[key] = {
                "step": 0,
                "numel": n,
                "worker_error": None,
                "server_error": None,
            }
        elif st["numel"] != n:
            raise ValueError(
                f"bucket {key!r} had {st['numel']} elements when its state was made but has "
                f"{n} now: the model or the bucket layout changed; start a fresh OneBit"
            )
        if st["worker_error"] is None and st["step"] >= self.warmup_steps:
            P = padded_numel(n, w)
            st["worker_error"] = torch.zeros(P, dtype=torch.float32, device=flat.device)
            st["server_error"] = torch.zeros(P // w, dtype=torch.float32, device=flat.device)
        return st

    def reduce_steps(
        self, key: Any, flat: torch.Tensor, *, group: Any = None, shapes: Any = None
    ) -> Steps:
        w = comm.get_world_size(group)
        self._check_world(w)
        st = self._entry(key, flat, w)
        self.last_skipped = False
        if st["step"] < self.warmup_steps:
            yield [comm.all_reduce(flat, op="avg", group=group, async_op=True)]
            st["step"] += 1
            return flat
        try:
            segments = (
                [int(torch.Size(x).numel()) for x in shapes]
                if self.per_tensor_scales and shapes
                else None
            )
            yield from onebit_steps(flat, st["worker_error"], st["server_error"], group, segments)
        except NonFiniteError:
            if self.on_nonfinite == "raise":
                raise
            self.skipped_steps += 1
            self.last_skipped = True
            return flat
        st["step"] += 1
        return flat

    def wire_bytes(self, flat: torch.Tensor, group: Any = None) -> int:
        return compressed_bytes(flat.numel(), comm.get_world_size(group))

    def _check_world(self, w: int) -> None:
        if self._world is None:
            self._world = w
        elif self._world != w:
            raise ValueError(
                f"this OneBit was used with {self._world} ranks, now {w}: its "
                "error feedback is laid out per rank; use a fresh OneBit"
            )

    def state_dict(self) -> dict[str, Any]:
        def clone(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.detach().clone()

        return {
            "name": self.name,
            "world_size": self._world,
            "warmup_steps": self.warmup_steps,
            "skipped_steps": self.skipped_steps,
            "state": {
                k: {
                    "step": v["step"],
                    "numel": v["numel"],
                    "worker_error": clone(v["worker_error"]),
                    "server_error": clone(v["server_error"]),
                }
                for k, v in self.state.items()
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(
                f"this state is for the {state.get('name')!r} compressor, not 'onebit'"
            )
        saved_w = state.get("world_size")
        if comm.is_initialized() and saved_w is not None:
            w = comm.get_world_size()
            if saved_w != w:
                raise ValueError(
                    f"this OneBit state was saved on {saved_w} ranks but this job has {w}: "
                    "error-feedback buffers are laid out per rank and cannot be resharded; "
                    "resume on the same number of ranks or start a fresh OneBit"
                )
        for k, v in state["state"].items():
            if v["worker_error"] is not None and saved_w:
                P = padded_numel(v["numel"], saved_w)
                if v["worker_error"].numel() != P or v["server_error"].numel() != P // saved_w:
                    raise ValueError(
                        f"bucket {k!r}: error buffers do not match {v['numel']} "
                        f"elements on {saved_w} ranks; the state is corrupt"
                    )
        self._world = saved_w
        self.warmup_steps = int(state.get("warmup_steps", self.warmup_steps))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.state = {
            k: {
                "step": v["step"],
                "numel": v["numel"],
                "worker_error": None if v["worker_error"] is None else v["worker_error"].clone(),
                "server_error": None if v["server_error"] is None else v["server_error"].clone(),
            }
            for k, v in state["state"].items()
        }
