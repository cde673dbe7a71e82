"""The 1-bit codec in torch ops: the CUDA path, and the CPU fallback without numba.

Each stage is a fixed number of kernels whatever the number of segments: per-element segment
indices (built once per layout and device) turn per-segment scales into per-element ones by
a gather, and ``segment_reduce`` sums squares per contiguous segment (deterministic, unlike an
atomic ``index_add``). Elementwise values are the same float32 operations in the same order as
the numba kernels, so they agree bitwise; the scales' sums of squares are float64 in both, in
different orders (the scales agree to about one float32 ulp).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from overlap.compression.codec import Codec, ErrorFeedback
from overlap.compression.layout import Layout
from overlap.compression.packbits import pack_signs, sign_table

__all__ = ["TorchCodec"]


class _Index:
    """A layout's per-element index tensors on one device."""

    def __init__(self, lay: Layout, dev: torch.device) -> None:
        def t(a: Any) -> torch.Tensor:
            return torch.as_tensor(a, dtype=torch.int64, device=dev)

        self.lengths = t(lay.seg_len)
        self.local_len = t(lay.local_len)
        ids = torch.arange(lay.nseg, device=dev)
        self.seg_id = torch.repeat_interleave(ids, self.lengths, output_size=lay.P)
        base = lay.me * lay.chunk
        self.local_id = self.seg_id[base : base + lay.chunk]
        owner = torch.arange(lay.n, device=dev) // max(lay.chunk, 1)
        self.rebuild = owner * lay.nseg + self.seg_id[: lay.n]


def _error(v: torch.Tensor, s: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = v - copysign(s, v): the kernels' form of v - s * sign(v) (equal, as no stored
    value is -0.0; see :mod:`overlap.compression.numba_kernels`)."""
    return torch.sub(v, torch.copysign(s, v), out=out)


def _seg_rms(v: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """sqrt(mean(v**2)) per contiguous segment (0 for an empty one), summed in float64 like
    the kernels: ``segment_reduce`` adds sequentially on CPU, and float32 there drifts by
    3e-5 relative at 70k elements."""
    sq = torch.segment_reduce(v.double().square(), "sum", lengths=lengths)
    return torch.sqrt(sq / lengths.clamp(min=1)).float()


class TorchCodec(Codec):
    name = "torch"

    def _index(self, lay: Layout, dev: torch.device) -> _Index:
        key = ("torch", str(dev))
        ix = lay.cache.get(key)
        if ix is None:
            ix = lay.cache[key] = _Index(lay, dev)
        return ix  # type: ignore[no-any-return]

    def encode(
        self, x: torch.Tensor, lay: Layout, ef: ErrorFeedback
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ix = self._index(lay, x.device)
        b = ef.take_spare()
        _error(ef.wb, ef.ws[ix.seg_id], b)  # the worker error, applied lazily
        torch.add(x.reshape(-1), b[: lay.n], out=b[: lay.n])
        b.add_(0.0)  # no -0.0 is ever stored, as in the kernels
        return pack_signs(b), _seg_rms(b, ix.lengths), b

    def server(
        self, recv: torch.Tensor, q: torch.Tensor, lay: Layout, ef: ErrorFeedback
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ix = self._index(lay, recv.device)
        table = sign_table(recv.device)
        signs = table[recv.long()].reshape(lay.w, lay.chunk)
        acc = torch.zeros(lay.chunk, dtype=torch.float32, device=recv.device)
        for r in range(lay.w):  # in rank order, as the reference sums
            acc.addcmul_(signs[r], q[r][ix.local_id])
        err = _error(ef.sc, ef.ss[ix.local_id], torch.empty_like(ef.sc))
        torch.add(acc, err, out=ef.sc)
        return pack_signs(ef.sc), _seg_rms(ef.sc, ix.local_len)

    def rebuild(
        self,
        signs: torch.Tensor,
        sscales: torch.Tensor,
        lay: Layout,
        out: torch.Tensor,
        direct: Sequence[tuple[int, torch.Tensor]] = (),
    ) -> None:
        ix = self._index(lay, signs.device)
        table = sign_table(signs.device)
        unpacked = table[signs.long()].reshape(-1)[: lay.n]
        torch.mul(unpacked, sscales.reshape(-1)[ix.rebuild], out=out)
        for a, t in direct:  # one launch per tensor: the CUDA path keeps the copy
            t.view(-1).copy_(out[a : a + t.numel()])
