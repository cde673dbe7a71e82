"""The 1-bit codec's CPU kernels: numba, one memory pass per stage, compiled ahead of use.

Each stage is one pass over its data, tile by tile (:mod:`overlap.compression.layout`):

* ``encode``: b = x + (wb - ws * sign(wb)) (the lazily applied worker error, see
  :class:`~overlap.compression.codec.ErrorFeedback`), written to the spare buffer, its signs
  packed and its squares summed per piece on the way. Reads x and wb, writes b.
* ``server``: c = sum over ranks (in rank order) of +-q_r + (sc - ss * sign(sc)), written back
  over sc in place; signs packed; sums of squares per piece.
* ``rebuild``: out = +-sscale of the owning chunk and segment, straight into the buffer.

The elementwise arithmetic is plain IEEE float32 in the reference's order (DESIGN.md section
4), so those values are bitwise what the torch path computes. Only the sums of squares are
reassociated (``fastmath`` reassoc, float64 accumulators) so they vectorise; that changes a
scale by about one float32 ulp against torch's norm, never across ranks (each scale is
computed by one rank and sent) nor across runs.

Kernels release the GIL and are compiled with explicit signatures when :func:`kernels` is
first called (the compressor's constructor calls it), or loaded from numba's on-disk cache,
so no step of training pays for a compile. A call splits its range into block-aligned parts
across up to ``torch.get_num_threads()`` threads.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from overlap.comm.knobs import switch
from overlap.compression.codec import Codec, ErrorFeedback, gather_sources
from overlap.compression.layout import BLOCK, Layout, Pieces

__all__ = ["NumbaCodec", "available", "kernels", "parallel"]

log = logging.getLogger(__name__)

_kernels: dict[str, Any] | None = None
_tried = False
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
MIN_PER_THREAD = 8 * BLOCK  # below this a second thread costs more than it saves
# read at import, so a value it cannot read fails there, not in a bucket's first reduction
_NUMBA_ON = switch("OVERLAP_NUMBA", True)


def _build() -> dict[str, Any] | None:
    if not _NUMBA_ON:
        return None
    try:
        import numba  # noqa: F401
    except ImportError:
        return None

    t0 = time.perf_counter()
    try:
        from overlap.compression import numba_kernels
    except Exception as exc:  # a numba/LLVM that cannot build them: the torch codec works
        log.warning("the 1-bit codec's numba kernels failed to build (%s); using torch ops", exc)
        return None

    log.debug("1-bit codec kernels ready in %.2f s", time.perf_counter() - t0)
    return dict(numba_kernels.KERNELS)


def kernels() -> dict[str, Any] | None:
    """The compiled kernels (compiled or loaded from cache on the first call), or None
    without numba or with ``OVERLAP_NUMBA=0``."""
    global _kernels, _tried
    with _lock:
        if not _tried:
            _kernels = _build()
            _tried = True
    return _kernels


def available() -> bool:
    return kernels() is not None


def kernel_module(name: str) -> Any:
    """The numba kernel module ``name`` (imported, so compiled or loaded from cache now),
    or None when numba is missing or off (``OVERLAP_NUMBA=0``): the caller then uses torch
    ops. Int8's kernels and DiLoCo's fused landing load theirs through this."""
    if not available():
        return None
    return importlib.import_module(name)


def _threads(length: int) -> int:
    import torch

    return max(1, min(torch.get_num_threads(), length // MIN_PER_THREAD))


def parallel(pieces: Pieces, call: Callable[[int, int, int], None]) -> None:
    """Run ``call(first_piece, lo, hi)`` over block-aligned parts of ``pieces``' range."""
    global _pool
    nt = _threads(pieces.length)
    nb = pieces.nblocks
    cuts = [nb * i // nt for i in range(nt + 1)]
    parts = [
        (int(pieces.block_ptr[a]), a * BLOCK, min(b * BLOCK, pieces.length))
        for a, b in itertools.pairwise(cuts)
        if b > a
    ]
    if len(parts) <= 1:
        for part in parts:
            call(*part)
        return
    if _pool is None or _pool._max_workers < len(parts) - 1:
        _pool = ThreadPoolExecutor(max_workers=len(parts) - 1, thread_name_prefix="overlap-codec")
    futures = [_pool.submit(call, *part) for part in parts[1:]]
    call(*parts[0])
    for f in futures:
        f.result()


def _scales(partial: np.ndarray, pieces: Pieces, lengths: np.ndarray, nseg: int) -> Any:
    """Per-segment sqrt(sum of squares / length) from per-piece partials, in piece order
    (``bincount`` adds sequentially, so the result does not depend on the thread split)."""
    import torch

    sums = np.bincount(pieces.seg, weights=partial, minlength=nseg)
    rms = np.sqrt(sums / np.maximum(lengths, 1)).astype(np.float32)
    return torch.from_numpy(rms)


def _segment_sources(x: Any, lay: Layout, sources: Any) -> np.ndarray:
    """Per segment of ``lay``, the address the encode kernel reads its input from (0: x).

    A source that is exactly one segment, contiguous float32 on the CPU, is read where it
    is: the scheduler then never copies that gradient into the bucket (one read and one
    write pass saved). Any other (one scale for the whole bucket, another dtype) is copied
    into x here. The caller keeps the sources alive for the kernel's call."""
    import torch

    src = np.zeros(lay.nseg, dtype=np.int64)
    if not len(sources):
        return src
    starts = lay.cache.get("numba-seg-index")
    if starts is None:
        # the tensors' segments; with one segment (the whole padded buffer) that one, which
        # a source covers exactly only when there is no padding (checked below)
        tensors = lay.seg_start[:-1] if lay.nseg > 1 else lay.seg_start
        starts = lay.cache["numba-seg-index"] = {int(a): k for k, a in enumerate(tensors)}
    for a, t in sources:
        k = starts.get(int(a))
        if (
            k is not None
            and int(lay.seg_len[k]) == t.numel() > 0
            and t.dtype == torch.float32
            and t.device.type == "cpu"
            and t.is_contiguous()
        ):
            src[k] = t.data_ptr()
        else:
            gather_sources(x, [(a, t)])
    return src


class NumbaCodec(Codec):
    """The CPU codec on the numba kernels above."""

    name = "numba"

    def __init__(self) -> None:
        k = kernels()
        if k is None:
            raise RuntimeError("NumbaCodec needs numba (pip install numba)")
        self.k = k

    def encode(
        self, x: Any, lay: Layout, ef: ErrorFeedback, sources: Any = (), mean_with: Any = None
    ) -> Any:
        import torch

        xn = x.reshape(-1)
        if xn.dtype != torch.float32:
            xn = xn.float()
        src = _segment_sources(xn, lay, sources)
        b = ef.take_spare()
        packed = ef.scratch("packed", lay.P // 8, torch.uint8).numpy()
        pc = lay.worker
        partial = np.empty(len(pc), dtype=np.float64)
        y = xn if mean_with is None else mean_with.reshape(-1)
        args = (
            xn.numpy(),
            src,
            lay.seg_start,
            y.numpy(),
            int(mean_with is not None),
            ef.wb.numpy(),
            ef.ws.numpy(),
            b.numpy(),
            packed,
        )
        enc = self.k["encode"]
        parallel(pc, lambda q, lo, hi: enc(*args, pc.start, pc.end, pc.seg, q, lo, hi, partial))
        return torch.from_numpy(packed), _scales(partial, pc, lay.seg_len, lay.nseg), b

    def server(self, recv: Any, q: Any, lay: Layout, ef: ErrorFeedback) -> Any:
        import torch

        packed = ef.scratch("spacked", lay.chunk // 8, torch.uint8).numpy()
        pc = lay.server
        partial = np.empty(len(pc), dtype=np.float64)
        args = (recv.numpy(), q.contiguous().numpy(), ef.sc.numpy(), ef.ss.numpy(), packed)
        srv = self.k["server"]
        parallel(
            pc,
            lambda p, lo, hi: srv(*args, pc.start, pc.end, pc.seg, p, lo, hi, partial),
        )
        return torch.from_numpy(packed), _scales(partial, pc, lay.local_len, lay.nseg)

    def error(self, v: Any, scales: Any, lay: Layout, side: str, out: Any) -> Any:
        """One pass (``unlazy``): out = v - copysign(scale, v), bitwise what the torch form
        gives. compressed_allreduce writes both true errors back this way on every call:
        the torch form's four passes (copysign, neg, add) took 73 of its 129 ms at 16M
        floats on 2 ranks."""
        import torch

        if not (
            v.dtype == out.dtype == torch.float32
            and v.is_contiguous()
            and out.is_contiguous()
            and not v.requires_grad
            and not out.requires_grad
        ):
            return super().error(v, scales, lay, side, out)
        pc = lay.worker if side == "worker" else lay.server
        args = (v.numpy(), scales.contiguous().numpy(), out.numpy(), pc.start, pc.end, pc.seg)
        unlazy = self.k["unlazy"]
        parallel(pc, lambda q, lo, hi: unlazy(*args, q, lo, hi))
        return out

    def rebuild(self, signs: Any, sscales: Any, lay: Layout, out: Any, direct: Any = ()) -> None:
        pc = lay.rebuild
        args = (signs.numpy(), sscales.contiguous().numpy())
        reb = self.k["rebuild"]
        if not direct:
            o = out.numpy()
            parallel(
                pc,
                lambda q, lo, hi: reb(*args, o, pc.start, pc.end, pc.seg, pc.owner, q, lo, hi, 0),
            )
            return
        for lo, hi, dst, off in _ranges(lay.n, out, direct):
            q = int(np.searchsorted(pc.end, lo, side="right"))
            reb(*args, dst.numpy(), pc.start, pc.end, pc.seg, pc.owner, q, lo, hi, off)


def _ranges(n: int, out: Any, direct: Any) -> list[tuple[int, int, Any, int]]:
    """(lo, hi, destination, offset) covering [0, n): ``direct``'s (start, tensor) pairs
    write into their tensors, the gaps into ``out``."""
    parts, cur = [], 0
    for a, t in sorted(direct, key=lambda d: d[0]):
        if a > cur:
            parts.append((cur, a, out, 0))
        parts.append((a, a + t.numel(), t.reshape(-1), a))
        cur = a + t.numel()
    if cur < n:
        parts.append((cur, n, out, 0))
    return parts
