"""Where each element of a 1-bit buffer sits: segment, owner chunk, tile and block.

The codec kernels (:mod:`overlap.compression.codec`) walk a buffer in *pieces*: maximal runs
of elements that share one segment (one tensor of the bucket, or the padding) and lie inside
one tile. A piece has one worker scale, one server scale and one owner, so a kernel fills a
tile's per-element scales from its pieces and then runs a branch-free byte loop over the tile.

Pieces never cross a :data:`BLOCK` boundary, and the threads of a kernel split the buffer at
block boundaries. Each piece's sum of squares is a separate partial, summed per segment in
piece order afterwards, so the scales do not depend on how many threads ran.

A layout is built once per (segments, world size, rank) and cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["BLOCK", "TILE", "Layout", "layout", "padded_numel"]

TILE = 2048  # elements per tile: 8 KiB of float32, so a tile's scratch stays in L1
BLOCK = 32 * TILE  # elements per block: the unit a kernel's threads split the buffer by


def padded_numel(n: int, world_size: int) -> int:
    """P: ``n`` rounded up to a multiple of 8 x ``world_size`` (0 stays 0)."""
    if n < 0 or world_size < 1:
        raise ValueError(f"padded_numel needs n >= 0 and world_size >= 1, got {n}, {world_size}")
    m = 8 * world_size
    return -(-n // m) * m


class Pieces:
    """Pieces of one range [0, length): start, end, segment (and owner chunk) per piece."""

    def __init__(self, length: int, cuts: np.ndarray, seg_start: np.ndarray, chunk: int) -> None:
        grid = np.arange(0, length, TILE, dtype=np.int64)
        pts = np.unique(np.concatenate([cuts[(cuts > 0) & (cuts < length)], grid, [0, length]]))
        self.length = length
        self.start = np.ascontiguousarray(pts[:-1], dtype=np.int64)
        self.end = np.ascontiguousarray(pts[1:], dtype=np.int64)
        self.seg = np.searchsorted(seg_start, self.start, side="right").astype(np.int64) - 1
        self.owner = (self.start // chunk).astype(np.int64) if chunk else self.seg * 0
        nblocks = -(-length // BLOCK)
        self.nblocks = nblocks
        self.block_ptr = np.searchsorted(
            self.start, np.arange(nblocks + 1, dtype=np.int64) * BLOCK
        ).astype(np.int64)

    def __len__(self) -> int:
        return int(self.start.shape[0])


class Layout:
    """The segments of a buffer of ``n`` elements on ``w`` ranks, seen from rank ``me``.

    ``segments`` (lengths adding up to n) gives each tensor of a bucket its own scales; the
    padding [n, P) is then a segment of its own. With None or one segment, the whole padded
    buffer is one segment (DESIGN.md section 4 exactly).
    """

    def __init__(self, n: int, w: int, me: int, segments: Sequence[int] | None) -> None:
        P = padded_numel(n, w)
        self.n, self.w, self.me, self.P = n, w, me, P
        self.chunk = P // w
        if segments is not None and len(segments) > 1:
            if sum(segments) != n or any(k < 0 for k in segments):
                raise ValueError(
                    f"segments {list(segments)} must be non-negative and add up to the "
                    f"buffer's {n} elements"
                )
            lengths = np.array([*segments, P - n], dtype=np.int64)
        else:
            lengths = np.array([P], dtype=np.int64)
        self.nseg = int(lengths.shape[0])
        self.seg_len = lengths
        self.seg_start = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        seg_end = self.seg_start + lengths
        chunks = np.arange(0, P + 1, max(self.chunk, 1), dtype=np.int64)
        cuts = np.concatenate([self.seg_start, seg_end])
        self.worker = Pieces(P, cuts, self.seg_start, self.chunk)
        self.rebuild = Pieces(n, np.concatenate([cuts, chunks]), self.seg_start, self.chunk)
        base = me * self.chunk
        local_start = np.clip(self.seg_start - base, 0, self.chunk)
        local_end = np.clip(seg_end - base, 0, self.chunk)
        self.local_len = (local_end - local_start).astype(np.int64)
        self.server = Pieces(self.chunk, np.concatenate([local_start, local_end]), local_start, 0)
        # local_start is not strictly increasing where segments miss this chunk: give each
        # local piece the segment that really holds it.
        self.server.seg = (
            np.searchsorted(self.seg_start, self.server.start + base, side="right").astype(np.int64)
            - 1
        )
        self.cache: dict[Any, Any] = {}  # per-codec derived forms (e.g. torch index tensors)


_LAYOUTS: dict[tuple[Any, ...], Layout] = {}


def layout(n: int, w: int, me: int, segments: Sequence[int] | None) -> Layout:
    """The cached :class:`Layout` for these arguments."""
    key = (n, w, me, None if segments is None or len(segments) < 2 else tuple(segments))
    lay = _LAYOUTS.get(key)
    if lay is None:
        if len(_LAYOUTS) > 256:
            _LAYOUTS.clear()
        lay = _LAYOUTS[key] = Layout(n, w, me, segments)
    return lay
