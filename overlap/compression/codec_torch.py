"""The 1-bit codec in torch ops: the CUDA path, and the CPU fallback without numba.

Each stage is a fixed number of kernels whatever the number of segments: per-element segment
indices (built once per layout and device) turn per-segment scales into per-element ones by
a gather (none with one segment: the scale broadcasts), and ``segment_reduce`` sums squares
per contiguous segment (deterministic, unlike an atomic ``index_add``). Elementwise values are
the same float32 operations in the same order as the numba kernels, so they agree bitwise.

Sums of squares: on CPU, float64 per segment, as the kernels. On CUDA in two levels: float32
squares summed per *piece* (at most one tile, :mod:`overlap.compression.layout`), then the
pieces' sums per segment in float64. CUDA's ``segment_reduce`` gives each segment one thread
block, so a one-segment 16M-float bucket ran on one SM: measured on an H100, the worker side
cost 112 read passes with the one-level form. The scales agree with the kernels' to about one
float32 ulp.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from overlap.compression.codec import Codec, ErrorFeedback, gather_sources
from overlap.compression.layout import Layout
from overlap.compression.packbits import pack_signs, unpack_signs

__all__ = ["TorchCodec"]


class _Index:
    """A layout's per-element index tensors on one device."""

    def __init__(self, lay: Layout, dev: torch.device, two_level: bool) -> None:
        def t(a: Any) -> torch.Tensor:
            return torch.as_tensor(a, dtype=torch.int64, device=dev)

        self.lengths = t(lay.seg_len)
        self.local_len = t(lay.local_len)
        # the mean of squares' divisors (an empty segment: 0 / 1), made once, not per call
        self.lengths_div = self.lengths.clamp(min=1)
        self.local_div = self.local_len.clamp(min=1)
        ids = torch.arange(lay.nseg, device=dev)
        self.seg_id = torch.repeat_interleave(ids, self.lengths, output_size=lay.P)
        base = lay.me * lay.chunk
        self.local_id = self.seg_id[base : base + lay.chunk]
        owner = torch.arange(lay.n, device=dev) // max(lay.chunk, 1)
        self.rebuild = (owner * lay.nseg + self.seg_id[: lay.n]).int()  # int32: 4 B a read
        self.seg_id, self.local_id = self.seg_id.int(), self.local_id.int()
        self.two_level = two_level
        if self.two_level:  # offsets of the pieces, and of each segment's first piece
            self.worker_pieces = (t(_offsets(lay.worker.end)), t(_per_seg(lay.worker.seg, lay)))
            self.server_pieces = (t(_offsets(lay.server.end)), t(_per_seg(lay.server.seg, lay)))


def _offsets(ends: np.ndarray) -> np.ndarray:
    """Offsets (n + 1, from 0) of contiguous runs that end at ``ends``."""
    return np.concatenate([[0], ends]).astype(np.int64)


def _per_seg(seg: np.ndarray, lay: Layout) -> np.ndarray:
    """Offsets into the pieces of each segment's pieces (pieces run in segment order)."""
    return _offsets(np.cumsum(np.bincount(seg, minlength=lay.nseg)))


def _error(
    v: torch.Tensor, s: torch.Tensor, out: torch.Tensor, tmp: torch.Tensor | None = None
) -> torch.Tensor:
    """out = v - copysign(s, v): the kernels' form of v - s * sign(v) (equal, as no stored
    value is -0.0; see :mod:`overlap.compression.numba_kernels`). ``tmp`` (v's size) holds
    the copysign, instead of a fresh allocation."""
    return torch.sub(v, torch.copysign(s, v, out=tmp), out=out)


def _seg_rms(
    v: torch.Tensor,
    lengths: torch.Tensor,
    divisor: torch.Tensor,
    pieces: tuple[torch.Tensor, torch.Tensor] | None = None,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """sqrt(mean(v**2)) per contiguous segment (0 for an empty one); ``divisor`` is
    ``lengths.clamp(min=1)``, made once per layout.

    Without ``pieces`` (CPU): summed in float64 per segment like the kernels
    (``segment_reduce`` adds sequentially on CPU, and float32 there drifts by 3e-5 relative at
    70k elements). With ``pieces`` ((offsets of the pieces, offsets of each segment's pieces),
    CUDA): float32 squares summed per piece of at most one tile, by a tree in each thread
    block, then float64 per segment (see the module docstring). Offsets, not lengths: the
    lengths form recomputes them each call (measured 0.078 against 0.055 ms at 16M floats)."""
    if pieces is None:
        sq = torch.segment_reduce(v.double().square(), "sum", lengths=lengths)
    else:
        piece_off, seg_off = pieces
        squares = torch.mul(v, v, out=scratch) if scratch is not None else v * v
        # unsafe: the offsets come from the layout, and checking them costs a device-to-host
        # copy per call (measured: 0.14 against 0.08 ms at 16M floats)
        part = torch.segment_reduce(squares, "sum", offsets=piece_off, unsafe=True).double()
        sq = torch.segment_reduce(part, "sum", offsets=seg_off, unsafe=True)
    return torch.sqrt(sq / divisor).float()


class TorchCodec(Codec):
    """The codec in torch ops. ``two_level`` picks the sums of squares' form (see the module
    docstring): None, the default, is two-level on CUDA only; tests force it on CPU."""

    name = "torch"

    def __init__(self, two_level: bool | None = None) -> None:
        self.two_level = two_level

    def _index(self, lay: Layout, dev: torch.device) -> _Index:
        two = dev.type == "cuda" if self.two_level is None else self.two_level
        key = ("torch", str(dev), two)
        ix = lay.cache.get(key)
        if ix is None:
            ix = lay.cache[key] = _Index(lay, dev, two)
        return ix  # type: ignore[no-any-return]

    def encode(
        self,
        x: torch.Tensor,
        lay: Layout,
        ef: ErrorFeedback,
        sources: Sequence[tuple[int, torch.Tensor]] = (),
        mean_with: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gather_sources(x, sources)
        if mean_with is not None:  # (x + y) * 0.5, rounded as the numba kernel rounds it
            x.reshape(-1).add_(mean_with.reshape(-1)).mul_(0.5)
        ix = self._index(lay, x.device)
        b = ef.take_spare()
        ws = ef.ws if lay.nseg == 1 else torch.index_select(ef.ws, 0, ix.seg_id)
        tmp = ef.scratch("torch-codec", lay.P, torch.float32)
        _error(ef.wb, ws, b, tmp)  # the worker error, applied lazily
        torch.add(x.reshape(-1), b[: lay.n], out=b[: lay.n])
        # No -0.0 is stored, as in the kernels: a difference of floats is -0.0 only as
        # (-0.0) - (+0.0), and copysign gives the minuend's own sign, so the error is never
        # -0.0; a sum is -0.0 only when both addends are.
        pieces = ix.worker_pieces if ix.two_level else None
        return pack_signs(b), _seg_rms(b, ix.lengths, ix.lengths_div, pieces, tmp), b

    def server(
        self, recv: torch.Tensor, q: torch.Tensor, lay: Layout, ef: ErrorFeedback
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ix = self._index(lay, recv.device)
        signs = unpack_signs(recv[:, : lay.chunk // 8]).reshape(lay.w, lay.chunk)
        acc = torch.zeros(lay.chunk, dtype=torch.float32, device=recv.device)
        one = lay.nseg == 1
        for r in range(lay.w):  # in rank order, as the reference sums
            acc.addcmul_(signs[r], q[r] if one else torch.index_select(q[r], 0, ix.local_id))
        ss = ef.ss if one else torch.index_select(ef.ss, 0, ix.local_id)
        err = _error(ef.sc, ss, ef.scratch("torch-codec-server", lay.chunk, torch.float32))
        torch.add(acc, err, out=ef.sc)
        pieces = ix.server_pieces if ix.two_level else None
        return pack_signs(ef.sc), _seg_rms(ef.sc, ix.local_len, ix.local_div, pieces, err)

    def rebuild(
        self,
        signs: torch.Tensor,
        sscales: torch.Tensor,
        lay: Layout,
        out: torch.Tensor,
        direct: Sequence[tuple[int, torch.Tensor]] = (),
    ) -> None:
        ix = self._index(lay, signs.device)
        unpacked = unpack_signs(signs)[: lay.n]
        torch.mul(unpacked, torch.index_select(sscales.reshape(-1), 0, ix.rebuild), out=out)
        for a, t in direct:  # one launch per tensor: the CUDA path keeps the copy
            t.view(-1).copy_(out[a : a + t.numel()])
