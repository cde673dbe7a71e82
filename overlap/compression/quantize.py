"""Block-quantized averaging: :class:`Int8` and :class:`FP8`, with error feedback.

A buffer is averaged in two phases, as the 1-bit allreduce is (and as INTELLECT-1's int8
ring is), because a sum of 8-bit values overflows 8 bits:

1. each rank adds its worker error, cuts the (padded) buffer into blocks of ``block``
   elements, stores each block as one float32 scale (absmax / the type's largest value) and
   one 8-bit code per element, and sends chunk j of codes and scales to rank j
   (all_to_all);
2. rank j decodes the W copies of its chunk, averages them in float32, adds its server
   error, quantizes the average again and every rank gathers every chunk (all_gather), then
   decodes it into the buffer.

Given the bucket's tensor ``shapes`` (the BucketScheduler passes them), each tensor starts a
block of its own: the buffer is laid out with every tensor padded to whole blocks, so a
block never mixes two tensors, and a small tensor's values are not quantized on the scale of
a larger neighbour's (as OneBit has a scale per tensor). Measured on a 2-rank MLP whose
300-float bias shared a block with a 10x larger weight, the bias's averaged gradient was
7-11% off the exact mean (relative norm) with blocks across tensors and 0.5-1.6% aligned
(docs/compression.md). DiLoCo passes its fragments' parameter shapes alike. Without shapes
(a direct call) the buffer is cut into blocks as it is.

Each quantization's error (what was meant minus what was sent) is kept per bucket key and
added to the next call with the same key: nothing is lost, only delayed. A rank sends
2 (W-1)/W (P + 4 P / block) bytes where an fp32 ring allreduce sends 2 (W-1)/W 4 P: with the
default block of 1024, 3.98x fewer.

Int8's three stages run as numba kernels on CPU, one pass over memory each
(:mod:`overlap.compression.int8_kernels`); FP8, and Int8 on CUDA or without numba, on torch
ops.

A non-finite input shows as a non-finite scale after phase 2 on every rank alike: the error
state is left as it was and, by ``on_nonfinite``, the call raises
:class:`~overlap.errors.NonFiniteError` everywhere (the buffer unchanged) or skips (the
buffer NaN everywhere; :mod:`overlap.compression.nonfinite`). Codes travel as uint8, so
FP8 runs on gloo too (gloo refuses float8 tensors).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from overlap import comm
from overlap.comm.steps import Steps
from overlap.compression.base import Compressor
from overlap.compression.codec import kept_buffer
from overlap.compression.codec_numba import kernel_module
from overlap.compression.nonfinite import SkipsNonFinite, nan_result
from overlap.errors import NonFiniteError

__all__ = ["FP8", "BlockCodes", "Int8"]

log = logging.getLogger(__name__)

# (source offset, elements, offset in the laid-out buffer) of each tensor of a bucket
Segments = tuple[tuple[int, int, int], ...]
# in a state_dict: the errors of a bucket given shapes are laid out per tensor (_segments)
LAYOUT = "per-tensor"


@dataclass(frozen=True)
class BlockCodes:
    """A block-quantized average, not yet decoded: what ``Int8.reduce(..., encoded=True)``
    resolves to. Element i of the average is ``codes[j] (int8) * scales[j // block]``, with
    j = i without ``segments``; with them, element a + t of the tensor that starts at a is
    at j = ``at(a)`` + t.

    ``codes`` and ``scales`` are the compressor's kept buffers for the call's key: valid
    until the next call with that key (DiLoCo's next sync of the fragment comes after its
    landing). Every scale is finite (the call raised NonFiniteError otherwise)."""

    codes: torch.Tensor  # int8 [padded]
    scales: torch.Tensor  # float32 [padded / block]
    block: int
    flat: torch.Tensor  # the buffer the call averaged; decode() fills it
    owner: _BlockQuantized
    # the call's tensors, each from a block boundary (_BlockQuantized._segments); None: one
    # run of blocks, element i at codes[i]
    segments: Segments | None = None

    def decode(self) -> torch.Tensor:
        """The average decoded into ``flat`` (what a call without ``encoded`` returns)."""
        self.owner._decode_into(self.codes.view(torch.uint8), self.scales, self.flat, self.segments)
        return self.flat

    def at(self, a: int) -> int:
        """Where in ``codes`` the tensor that starts at element ``a`` of ``flat`` starts:
        ``a`` itself without segments. A tensor of no elements may be given the next one's
        place (nothing is read there)."""
        if self.segments is None:
            return a
        for src, _, dst in self.segments:
            if src >= a:
                return dst if src == a else self.codes.numel()
        return self.codes.numel()


class _BlockQuantized(SkipsNonFinite, Compressor):
    """Shared two-phase algorithm; subclasses give the 8-bit code (``_encode``/``_decode``)."""

    summable = False
    top: ClassVar[float]  # the largest magnitude a code stands for

    def __init__(
        self, block: int = 1024, error_feedback: bool = True, on_nonfinite: str = "raise"
    ) -> None:
        self._init_nonfinite(on_nonfinite)
        if not isinstance(block, int) or isinstance(block, bool) or block < 1:
            raise ValueError(f"block must be a positive int (elements per scale), got {block!r}")
        self.block = block
        self.error_feedback = bool(error_feedback)
        self.state: dict[Hashable, dict[str, torch.Tensor]] = {}
        # Per key, buffers kept for the next call with that key (codes, scales, received
        # copies, the next error states): calls on one key run one after another, and a
        # fresh few-MiB buffer costs its page faults on every call.
        self._bufs: dict[Hashable, dict[str, torch.Tensor]] = {}  # see kept_buffer
        # per key: (n, shapes) -> the tensor-aligned layout (see _segments)
        self._layouts: dict[Hashable, tuple[Any, Segments | None]] = {}
        self._before: set[Hashable] = set()  # keys loaded from an earlier layout

    def _buf(
        self, key: Hashable, name: str, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return kept_buffer(self._bufs.setdefault(key, {}), name, numel, dtype, device)

    def reset(self) -> None:
        super().reset()
        self._bufs.clear()
        self._layouts.clear()

    def _segments(
        self, key: Hashable, n: int, shapes: Sequence[torch.Size] | None
    ) -> Segments | None:
        """(source offset, elements, offset in the padded buffer) of each tensor of the
        bucket, each starting a block of its own; None when the buffer is cut as it is
        (no shapes, one tensor, or shapes that do not add up to ``n``). Kept per key."""
        if not shapes or len(shapes) < 2:
            return None
        sig = (n, tuple(tuple(x) for x in shapes))
        had = self._layouts.get(key)
        if had is not None and had[0] == sig:
            return had[1]
        segs = self._layout(n, shapes)
        self._layouts[key] = (sig, segs)
        return segs

    def _layout(self, n: int, shapes: Sequence[torch.Size] | None) -> Segments | None:
        """:meth:`_segments`, made anew."""
        if not shapes or len(shapes) < 2:
            return None
        sizes = [int(torch.Size(x).numel()) for x in shapes]
        if sum(sizes) != n:
            return None
        src, dst, out = 0, 0, []
        for k in sizes:
            if k:
                out.append((src, k, dst))
                src, dst = src + k, dst + self._whole_blocks(k)
        return tuple(out) if out and dst > n else None  # no padding: as it is

    def _span(self, n: int, segs: Segments | None) -> int:
        """Elements of the laid-out buffer before its padding to W equal chunks."""
        if segs is None:
            return n
        _, k, dst = segs[-1]
        return dst + self._whole_blocks(k)

    def _whole_blocks(self, k: int) -> int:
        """Elements of the whole blocks that ``k`` elements start (a tensor's room)."""
        return -(-k // self.block) * self.block

    def _kept(self, p: int, w: int, device: torch.device) -> list[tuple[str, int, torch.dtype]]:
        """(name, elements, dtype) of every buffer a call keeps, for ``p`` padded elements on
        ``w`` ranks: the received and gathered codes and scales."""
        nb = p // self.block
        u8, f32 = torch.uint8, torch.float32
        return [("rcodes", p, u8), ("rscales", nb, f32), ("acodes", p, u8), ("ascales", nb, f32)]

    def prepare(
        self,
        key: Hashable,
        flat: torch.Tensor,
        group: Any = None,
        shapes: Sequence[torch.Size] | None = None,
    ) -> None:
        w, dev = comm.get_world_size(group), flat.device
        span = self._span(flat.numel(), self._segments(key, flat.numel(), shapes))
        for name, n, dtype in self._kept(self.padded(span, w), w, dev):
            self._buf(key, name, n, dtype, dev).zero_()  # zeroed: its pages are touched now

    def _next_error(
        self, key: Hashable, which: str, numel: int, device: torch.device
    ) -> torch.Tensor:
        """A buffer for the next ``which`` error state that is not the current one (the
        current one stays intact until phase 2 shows every scale finite)."""
        current = self.state.get(key, {}).get(which)
        for name in (f"{which}_a", f"{which}_b"):
            t = self._buf(key, name, numel, torch.float32, device)
            if current is None or t.data_ptr() != current.data_ptr():
                return t
        raise AssertionError("unreachable: two distinct buffers")  # pragma: no cover

    # ------------------------------------------------------------------ the code
    def _encode(self, scaled: torch.Tensor) -> torch.Tensor:
        """float32 values in [-top, top] -> uint8 codes."""
        raise NotImplementedError

    def _decode(self, codes: torch.Tensor) -> torch.Tensor:
        """uint8 codes -> float32 values."""
        raise NotImplementedError

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes uint8 [P], scales float32 [P / block]) of a padded float32 vector."""
        blocks = x.view(-1, self.block)
        scales = blocks.abs().amax(dim=1).div_(self.top)
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = self._encode(blocks / safe[:, None])
        return codes.reshape(-1), scales

    def _dequantize(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return (self._decode(codes).view(-1, self.block) * scales[:, None]).reshape(-1)

    # ------------------------------------------------------------------ the reduction
    def padded(self, n: int, w: int) -> int:
        """Elements after padding ``n`` to whole blocks in W equal chunks."""
        unit = self.block * w
        return -(-n // unit) * unit

    def wire_bytes(
        self, flat: torch.Tensor, group: Any = None, shapes: Sequence[torch.Size] | None = None
    ) -> int:
        """Bytes a rank sends for ``flat``; given its tensor ``shapes``, as laid out per
        tensor (the padding of each tensor to whole blocks travels too)."""
        w = comm.get_world_size(group)
        p = self.padded(self._span(flat.numel(), self._layout(flat.numel(), shapes)), w)
        return 2 * (w - 1) * (p + 4 * (p // self.block)) // w

    # The three stages, on torch ops; Int8 runs them as numba kernels on CPU.
    def _worker(
        self,
        flat: torch.Tensor,
        worker: torch.Tensor | None,
        p: int,
        key: Hashable,
        segs: Segments | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes, scales, new worker error) of ``flat`` (laid out by ``segs``, padded to
        ``p``) + ``worker``; ``key``'s buffers may be reused (the numba path does)."""
        x = torch.zeros(p, dtype=torch.float32, device=flat.device)
        if segs is None:
            x[: flat.numel()].copy_(flat.reshape(-1))
        else:
            src = flat.reshape(-1)
            for a, k, d in segs:
                x[d : d + k].copy_(src[a : a + k])
        if worker is not None:
            x.add_(worker)
        codes, scales = self._quantize(x)
        return codes, scales, x.sub_(self._dequantize(codes, scales))

    def _server(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        w: int,
        server: torch.Tensor | None,
        key: Hashable,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes, scales, new server error) of the average of the W received chunks."""
        avg = self._dequantize(codes, scales).view(w, -1).sum(0).div_(w)
        if server is not None:
            avg.add_(server)
        scodes, sscales = self._quantize(avg)
        return scodes, sscales, avg.sub_(self._dequantize(scodes, sscales))

    def _decode_into(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        flat: torch.Tensor,
        segs: Segments | None = None,
    ) -> None:
        n = flat.numel()
        values = self._dequantize(codes, scales)
        if segs is None:
            flat.copy_(values[:n].view_as(flat))
            return
        out = flat.view(-1)
        for a, k, d in segs:
            out[a : a + k].copy_(values[d : d + k])

    def reduce_steps(
        self,
        key: Hashable,
        flat: torch.Tensor,
        *,
        group: Any = None,
        shapes: Sequence[torch.Size] | None = None,
        outputs: Sequence[tuple[int, torch.Tensor]] = (),
        encoded: bool = False,
    ) -> Steps:
        w = comm.get_world_size(group)
        n = flat.numel()
        if n == 0:
            return flat
        segs = self._segments(key, n, shapes)
        p = self.padded(self._span(n, segs), w)
        if self._before:
            self._from_before(key, segs)
        st = self.state.get(key, {})
        worker = st.get("worker")
        if worker is not None and worker.numel() != p:
            raise ValueError(
                f"{self.name}: bucket {key!r} had {worker.numel()} padded elements and now has "
                f"{p}: call reset() when the buckets change"
            )
        codes, scales, new_worker = self._worker(flat, worker, p, key, segs)

        # phase 1: chunk j of codes and scales to rank j
        dev = codes.device
        rcodes = self._buf(key, "rcodes", codes.numel(), codes.dtype, dev)
        rscales = self._buf(key, "rscales", scales.numel(), scales.dtype, dev)
        yield [
            comm.all_to_all_single(rcodes, codes, group=group, async_op=True),
            comm.all_to_all_single(rscales, scales, group=group, async_op=True),
        ]

        # server side: the average of this rank's chunk, quantized again
        scodes, sscales, new_server = self._server(rcodes, rscales, w, st.get("server"), key)

        # phase 2: every chunk to everyone
        acodes = self._buf(key, "acodes", codes.numel(), codes.dtype, dev)
        ascales = self._buf(key, "ascales", scales.numel(), scales.dtype, dev)
        yield [
            comm.all_gather_into_tensor(acodes, scodes, group=group, async_op=True),
            comm.all_gather_into_tensor(ascales, sscales, group=group, async_op=True),
        ]
        if not bool(torch.isfinite(ascales).all()):
            self._nonfinite(
                NonFiniteError(
                    f"{self.name}: a rank's input holds NaN or Inf; the buffer and the error "
                    "state were left unchanged on every rank",
                    ranks=[],
                )
            )
            return nan_result(flat)  # skipped: NaN on every rank
        if self.error_feedback:
            self.state[key] = {"worker": new_worker, "server": new_server}
        if encoded and self.encodes_result:  # int8 codes only: FP8's are not BlockCodes'
            return BlockCodes(acodes.view(torch.int8), ascales, self.block, flat, self, segs)
        self._decode_into(acodes, ascales, flat, segs)
        return flat

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "block": self.block,
            "layout": LAYOUT,
            "state": {k: {n: t.clone() for n, t in v.items()} for k, v in self.state.items()},
        }

    def check_state(self, state: dict[str, Any]) -> None:
        super().check_state(state)
        if state.get("block") != self.block:
            raise ValueError(
                f"this state was saved with block={state.get('block')}, this {self.name} has "
                f"block={self.block}: build it with the saved block size"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        self.state = {
            k: {n: t.clone() for n, t in v.items()} for k, v in state.get("state", {}).items()
        }
        # saved before buckets were laid out per tensor: see _from_before
        self._before = set(self.state) if state.get("layout") != LAYOUT else set()

    def _from_before(self, key: Hashable, segs: Segments | None) -> None:
        """A key's error state loaded from a state saved before a bucket's tensors were
        laid out from block boundaries (no ``layout`` in it): where this key is laid out so
        now, the saved errors stand at other places (and may even be of the same length),
        so they are dropped, with a warning, and rebuilt by the next steps; a key cut as it
        is (one tensor, or tensors of whole blocks) keeps them."""
        self._before.discard(key)
        if segs is not None and self.state.pop(key, None) is not None:
            log.warning(
                "%s: the error feedback of key %r (a bucket, a DiLoCo fragment) was saved by "
                "an earlier overlap, whose blocks ran across its tensors; it does not fit the "
                "per-tensor layout and was dropped (the next steps rebuild it)",
                self.name,
                key,
            )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(block={self.block}, error_feedback={self.error_feedback}, "
            f"on_nonfinite={self.on_nonfinite!r})"
        )


class Int8(_BlockQuantized):
    """Two-phase int8 averaging with per-block scales and error feedback (4x fewer bytes than
    fp32, less the scales). Codes are round(x / scale), scale = block absmax / 127.
    ``on_nonfinite`` ("raise" or "skip"): see the module doc."""

    name = "int8"
    top = 127.0

    encodes_result = True  # reduce(encoded=True): BlockCodes

    def __init__(
        self, block: int = 1024, error_feedback: bool = True, on_nonfinite: str = "raise"
    ) -> None:
        super().__init__(block, error_feedback, on_nonfinite)
        # compiled (or loaded from cache) now, not in a training step
        self._k = kernel_module("overlap.compression.int8_kernels")

    def _fast(self, t: torch.Tensor) -> bool:
        return self._k is not None and t.device.type == "cpu"

    def _kept(self, p: int, w: int, device: torch.device) -> list[tuple[str, int, torch.dtype]]:
        kept = super()._kept(p, w, device)
        if self._k is None or device.type != "cpu":
            return kept
        chunk, i8, f32 = p // w, torch.int8, torch.float32
        return [
            *kept,
            ("codes", p, i8), ("scales", p // self.block, f32),
            ("worker_a", p, f32), ("worker_b", p, f32),
            ("scodes", chunk, i8), ("sscales", chunk // self.block, f32),
            ("server_a", chunk, f32), ("server_b", chunk, f32),
        ]  # fmt: skip

    def _worker(
        self,
        flat: torch.Tensor,
        worker: torch.Tensor | None,
        p: int,
        key: Hashable,
        segs: Segments | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self._fast(flat) or flat.dtype != torch.float32:
            return super()._worker(flat, worker, p, key, segs)
        cpu = torch.device("cpu")
        codes = self._buf(key, "codes", p, torch.int8, cpu)
        scales = self._buf(key, "scales", p // self.block, torch.float32, cpu)
        err = self._next_error(key, "worker", p, cpu)
        src = flat.reshape(-1).contiguous()
        has = worker is not None
        e_in, e_out = (worker if has else err).numpy(), err.numpy()  # type: ignore[union-attr]
        c, sc, b = codes.numpy(), scales.numpy(), self.block
        if segs is None:
            self._k.encode(src.numpy(), src.numel(), e_in, has, b, e_out, c, sc)
            return codes.view(torch.uint8), scales, err
        # one call per tensor, each on its own whole blocks, then the padding's blocks
        # (zero codes; the worker error carried as it is): the same kernel, on slices
        x = src.numpy()
        for a, k, d in (*segs, (0, 0, self._span(src.numel(), segs))):
            e = min(d + self._whole_blocks(k), p) if k else p
            if e > d:
                self._k.encode(
                    x[a : a + k], k, e_in[d:e], has, b, e_out[d:e], c[d:e], sc[d // b : e // b]
                )
        return codes.view(torch.uint8), scales, err

    def _server(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        w: int,
        server: torch.Tensor | None,
        key: Hashable,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self._fast(codes):
            return super()._server(codes, scales, w, server, key)
        chunk = codes.numel() // w
        cpu = torch.device("cpu")
        scodes = self._buf(key, "scodes", chunk, torch.int8, cpu)
        sscales = self._buf(key, "sscales", chunk // self.block, torch.float32, cpu)
        err = self._next_error(key, "server", chunk, cpu)
        self._k.server(
            codes.view(torch.int8).numpy(), scales.numpy(), w, self.block,
            (server if server is not None else err).numpy(), server is not None, err.numpy(),
            scodes.numpy(), sscales.numpy(),
        )  # fmt: skip
        return scodes.view(torch.uint8), sscales, err

    def _decode_into(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        flat: torch.Tensor,
        segs: Segments | None = None,
    ) -> None:
        if not self._fast(codes) or flat.dtype != torch.float32 or not flat.is_contiguous():
            return super()._decode_into(codes, scales, flat, segs)
        c, sc, b = codes.view(torch.int8).numpy(), scales.numpy(), self.block
        out = flat.view(-1).numpy()
        if segs is None:
            self._k.decode(c, sc, b, flat.numel(), out)
            return None
        for a, k, d in segs:
            self._k.decode(c[d:], sc[d // b :], b, k, out[a : a + k])
        return None

    def _encode(self, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.round().clamp_(-127, 127).to(torch.int8).view(torch.uint8)

    def _decode(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.view(torch.int8).to(torch.float32)


class FP8(_BlockQuantized):
    """Two-phase float8 (e4m3) averaging with per-block scales and error feedback: as
    :class:`Int8`, with codes of more range and less resolution near the block maximum.
    Needs a torch build with ``torch.float8_e4m3fn`` (2.1 and later)."""

    name = "fp8"
    top = 448.0

    def __init__(
        self, block: int = 1024, error_feedback: bool = True, on_nonfinite: str = "raise"
    ) -> None:
        if not hasattr(torch, "float8_e4m3fn"):
            raise RuntimeError(
                f"FP8 needs torch.float8_e4m3fn, which torch {torch.__version__} lacks: "
                "upgrade torch, or use overlap.Int8()"
            )
        super().__init__(block, error_feedback, on_nonfinite)

    def _encode(self, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.to(torch.float8_e4m3fn).view(torch.uint8)

    def _decode(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.view(torch.float8_e4m3fn).to(torch.float32)
