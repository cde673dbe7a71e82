"""The 1-bit codec behind one small interface, and its error-feedback state.

:func:`~overlap.compression.onebit.onebit_steps` is the algorithm (phases and collectives,
written once). The arithmetic of each phase goes through a :class:`Codec`:

* ``encode``: add the worker error, compute the worker scales, pack the signs;
* ``server``: accumulate the ranks' signs for the chunk this rank owns, add the server error,
  compute the server scales, pack the signs;
* ``rebuild``: write +-scale per element into the output.

Two implementations, picked once per device by :func:`codec_for`: numba kernels on CPU
(:mod:`overlap.compression.codec_numba`, one memory pass per stage) and torch ops
(:mod:`overlap.compression.codec_torch`; the CUDA path, and the CPU fallback without numba).

Error feedback is kept *lazily* (:class:`ErrorFeedback`): instead of the worker error
e = b - scale * sign(b), the state holds b and the scales, and the next ``encode`` applies
``- scale * sign(b)`` on the fly while it reads b. That saves the separate error-update pass
over P floats the eager form needs after phase 1 (DESIGN.md section 4 holds the update back
until every rank's scale is known finite, so it cannot be fused into the first pass), at the
cost of a second P-float buffer: ``encode`` writes the new b to a spare buffer, which becomes
the state only when phase 1 shows every scale finite. A non-finite step so leaves the state
untouched, as before. The server error is kept the same way, in place (it has no hold-back).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from overlap.compression.layout import Layout

__all__ = ["Codec", "ErrorFeedback", "codec_for", "gather_sources", "kept_buffer", "write_outputs"]

log = logging.getLogger(__name__)


def lazy_error(
    v: torch.Tensor, scales: torch.Tensor, lengths: Any, out: torch.Tensor
) -> torch.Tensor:
    """out = v - scales[segment] * sign(v), segment by segment (``lengths`` long, in order).

    Written as v - copysign(s, v), as the kernels do: equal to the reference's ``v >= 0``
    form except at v = -0.0, where only the sign of a zero can differ. Each segment's scale
    is broadcast, not expanded, and ``out`` (when it is not ``v``) is the only buffer
    written: fresh allocations cost page faults (measured: materialising 16M floats with
    an expanded scale vector and ``torch.where`` took 421 ms).
    """
    host = [float(x) for x in scales.tolist()]
    a = 0
    for k, length in enumerate(int(x) for x in lengths):
        if length == 0:
            continue
        vs, os_ = v[a : a + length], out[a : a + length]
        s = torch.tensor(host[k], dtype=v.dtype, device=v.device).expand(length)
        if os_.data_ptr() == vs.data_ptr():
            os_.sub_(torch.copysign(s, vs))
        else:
            torch.copysign(s, vs, out=os_)
            os_.neg_().add_(vs)  # v + (-c) is v - c exactly
        a += length
    return out


def kept_buffer(
    store: dict[str, torch.Tensor],
    name: str,
    numel: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """``store[name]`` if it has this size, dtype and device, else a new empty one kept there:
    a fresh allocation of a few MiB costs its page faults on every call. The caller owns the
    contents (nothing is zeroed) and must not use one buffer from two calls at once."""
    t = store.get(name)
    if t is None or t.numel() != numel or t.dtype != dtype or t.device != device:
        t = store[name] = torch.empty(numel, dtype=dtype, device=device)
    return t


def gather_sources(x: torch.Tensor, sources: Sequence[tuple[int, torch.Tensor]]) -> None:
    """Copy each (start, tensor) of ``sources`` into x[start : start + numel]."""
    flat = x.reshape(-1)
    for a, t in sources:
        flat[a : a + t.numel()].copy_(t.reshape(-1))


def write_outputs(flat: torch.Tensor, outputs: Sequence[tuple[int, torch.Tensor]]) -> None:
    """Copy flat's elements into the outputs (the paths that do not rebuild): the reverse
    of :func:`gather_sources`."""
    view = flat.reshape(-1)
    for a, t in outputs:
        t.view(-1).copy_(view[a : a + t.numel()])


class ErrorFeedback:
    """One buffer's 1-bit error-feedback state, in lazy form (see the module docstring).

    ``wb`` (P floats) with per-segment ``ws`` stands for the worker error
    wb - ws[segment] * sign(wb); ``sc`` (P/W) with ``ss`` for the server error likewise.
    Zero scales make the stored vector the error itself, which is how true errors are loaded.
    """

    def __init__(
        self,
        wb: torch.Tensor,
        sc: torch.Tensor,
        nseg: int,
        spare: torch.Tensor | None = None,
    ) -> None:
        self.wb = wb
        self.sc = sc
        self.ws = torch.zeros(nseg, dtype=torch.float32, device=wb.device)
        self.ss = torch.zeros(nseg, dtype=torch.float32, device=wb.device)
        self.spare = spare
        self._scratch: dict[str, torch.Tensor] = {}
        self.cache: dict[str, Any] = {}  # derived per-state helpers (onebit's message rows)

    def scratch(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer kept for the next call on this state (sign chunks, scales). Calls on one
        state run one after the other (the error feedback requires it), so reuse is safe."""
        return kept_buffer(self._scratch, name, numel, dtype, self.wb.device)

    @classmethod
    def zeros(cls, lay: Layout, device: torch.device) -> ErrorFeedback:
        z = torch.zeros
        return cls(
            z(lay.P, dtype=torch.float32, device=device),
            z(lay.chunk, dtype=torch.float32, device=device),
            lay.nseg,
        )

    def take_spare(self) -> torch.Tensor:
        """The P-float buffer ``encode`` writes the next b into."""
        if self.spare is None:
            self.spare = torch.zeros_like(self.wb)  # zeros: touch its pages now, not later
        return self.spare

    def commit_worker(self, b: torch.Tensor, scales: torch.Tensor) -> None:
        """Phase 1 showed every scale finite: b and its scales become the worker state."""
        self.spare, self.wb = self.wb, b
        self.ws = scales

    def worker_error(self, lay: Layout, out: torch.Tensor | None = None) -> torch.Tensor:
        """The worker error as DESIGN.md section 4 defines it (P floats)."""
        dst = torch.empty_like(self.wb) if out is None else out
        return codec_for(self.wb.device).error(self.wb, self.ws, lay, "worker", dst)

    def server_error(self, lay: Layout, out: torch.Tensor | None = None) -> torch.Tensor:
        """The server error of this rank's chunk (P/W floats)."""
        dst = torch.empty_like(self.sc) if out is None else out
        return codec_for(self.sc.device).error(self.sc, self.ss, lay, "server", dst)


class Codec(ABC):
    """The arithmetic of the 1-bit algorithm for one device (see the module docstring)."""

    name: str

    def error(
        self, v: torch.Tensor, scales: torch.Tensor, lay: Layout, side: str, out: torch.Tensor
    ) -> torch.Tensor:
        """A lazily held error made explicit: out = v - scales[segment] * sign(v) over the
        ``side`` ("worker": P floats, or "server": this rank's chunk); ``out`` may be ``v``."""
        lengths = lay.seg_len if side == "worker" else lay.local_len
        return lazy_error(v, scales, lengths, out)

    @abstractmethod
    def encode(
        self,
        x: torch.Tensor,
        lay: Layout,
        ef: ErrorFeedback,
        sources: Sequence[tuple[int, torch.Tensor]] = (),
        mean_with: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """b = x + worker error into ``ef.take_spare()``; returns (packed signs of b (P/8
        bytes), per-segment scales ||b_seg|| / sqrt(len) (float32), b). ``ef`` unchanged.

        ``sources``: (start, tensor) pairs, as :meth:`rebuild`'s ``direct``: elements
        [start, start + numel) of x are read from the tensor (x's copy of them may be
        stale). The numba codec reads a tensor that is exactly one segment in place; any
        other is first copied into x (:func:`gather_sources`).

        ``mean_with``: a contiguous float32 tensor of n elements; the input is then
        (x + mean_with) * 0.5 elementwise (x as ``sources`` give it), computed in the same
        pass (numba) or first, into x (torch ops: x is then overwritten)."""

    @abstractmethod
    def server(
        self, recv: torch.Tensor, q: torch.Tensor, lay: Layout, ef: ErrorFeedback
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """c = sum_r sign(recv[r]) * q[r, segment] + server error, written over ``ef.sc``;
        returns (packed signs of c, per-segment scales of c over this rank's chunk).

        ``recv`` is (W, >= chunk/8) uint8, C-contiguous: row r starts with rank r's chunk/8
        sign bytes for this chunk; bytes after them (the sender's scales) are ignored."""

    @abstractmethod
    def rebuild(
        self,
        signs: torch.Tensor,
        sscales: torch.Tensor,
        lay: Layout,
        out: torch.Tensor,
        direct: Sequence[tuple[int, torch.Tensor]] = (),
    ) -> None:
        """out[i] = sscales[owner(i), segment(i)] * sign(bit i), for the n output elements.

        ``direct``: (start, tensor) pairs, non-overlapping, each a contiguous float32 tensor
        that receives elements [start, start + numel) instead of ``out`` (whose copy of them
        is then left stale). The scheduler rebuilds straight into the gradients this way."""


_CODECS: dict[str, Codec] = {}


def codec_for(device: torch.device) -> Codec:
    """The codec for ``device``, built once (the numba kernels compile, or load from their
    cache, here: never inside a training step)."""
    key = device.type
    codec = _CODECS.get(key)
    if codec is None:
        from overlap.compression import codec_numba, codec_torch

        if key == "cpu" and codec_numba.available():
            codec = codec_numba.NumbaCodec()
        else:
            if key == "cpu":
                log.warning(
                    "numba is not importable (or OVERLAP_NUMBA=0): the 1-bit codec runs on "
                    "torch ops, several times slower; pip install numba to get the kernels"
                )
            codec = codec_torch.TorchCodec()
        _CODECS[key] = codec
    return codec
