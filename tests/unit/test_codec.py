"""The 1-bit codec's stages in one process: layouts, the numba kernels against the torch
codec and against the math of DESIGN.md section 4, the lazy error feedback, and that the
kernels are ready when a OneBit is built (no compile inside a step)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from overlap.compression import OneBit, codec_numba
from overlap.compression.codec import ErrorFeedback, codec_for
from overlap.compression.codec_torch import TorchCodec
from overlap.compression.layout import BLOCK, TILE, Layout, padded_numel

needs_numba = pytest.mark.skipif(not codec_numba.available(), reason="numba not importable")

CASES = [
    (38, 2, 1, None),
    (38, 3, 2, [10, 3, 24, 1]),
    (4099, 2, 0, [1, 4000, 98]),
    (70001, 3, 1, [65537, 7, 4457]),  # segments across tiles, blocks and chunks
    (3 * BLOCK + 5, 2, 1, None),
]


@pytest.mark.parametrize(("n", "w", "me", "segments"), CASES)
def test_layout_pieces_tile_the_buffer(n: int, w: int, me: int, segments: list[int] | None) -> None:
    lay = Layout(n, w, me, segments)
    assert padded_numel(n, w) == lay.P and lay.chunk * w == lay.P
    assert int(lay.seg_len.sum()) == lay.P
    for pc, length in ((lay.worker, lay.P), (lay.server, lay.chunk), (lay.rebuild, n)):
        assert pc.start[0] == 0 and pc.end[-1] == length
        assert np.array_equal(pc.start[1:], pc.end[:-1])  # contiguous, in order
        assert np.all(pc.end > pc.start)
        # no piece crosses a tile (so none crosses a block): sums do not depend on threads
        assert np.all(pc.start // TILE == (pc.end - 1) // TILE)
        assert np.array_equal(pc.start[pc.block_ptr[:-1]] % BLOCK, np.zeros(pc.nblocks))
    # each worker piece lies inside its segment
    seg_end = lay.seg_start + lay.seg_len
    pw = lay.worker
    assert np.all(lay.seg_start[pw.seg] <= pw.start) and np.all(pw.end <= seg_end[pw.seg])
    base = me * lay.chunk
    ps = lay.server
    assert np.all(lay.seg_start[ps.seg] <= ps.start + base)
    assert np.all(ps.end + base <= seg_end[ps.seg])
    assert int(lay.local_len.sum()) == lay.chunk


def _reference_stages(
    x: torch.Tensor, e: torch.Tensor, lay: Layout
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """b = x + e, per-segment rms (float64), and sign bits: straight from the math."""
    b = e.clone()
    b[: lay.n] += x
    scales = []
    for a, k in zip(lay.seg_start, lay.seg_len, strict=True):
        seg = b[a : a + k].double()
        scales.append(math.sqrt(float((seg * seg).sum()) / k) if k else 0.0)
    return b, torch.tensor(scales, dtype=torch.float32), b >= 0


@needs_numba
@pytest.mark.parametrize(("n", "w", "me", "segments"), CASES)
def test_numba_stages_match_torch_and_the_math(
    n: int, w: int, me: int, segments: list[int] | None
) -> None:
    lay = Layout(n, w, me, segments)
    gen = torch.Generator().manual_seed(n + w)
    x = torch.randn(n, generator=gen)
    efs = {c: ErrorFeedback.zeros(lay, torch.device("cpu")) for c in ("numba", "torch")}
    codecs = {"numba": codec_numba.NumbaCodec(), "torch": TorchCodec()}
    for ef in efs.values():  # some error state with pending scales
        ef.wb.copy_(torch.randn(lay.P, generator=torch.Generator().manual_seed(1)) * 0.1)
        ef.ws.fill_(0.05)
        ef.sc.copy_(torch.randn(lay.chunk, generator=torch.Generator().manual_seed(2)) * 0.1)
        ef.ss.fill_(0.02)
    e_true = efs["numba"].worker_error(lay)
    want_b, want_scale, want_sign = _reference_stages(x, e_true, lay)
    recv = torch.randint(0, 256, (w, lay.chunk // 8), dtype=torch.uint8, generator=gen)
    q = torch.rand(w, lay.nseg, generator=gen)
    signs = torch.randint(0, 256, (lay.P // 8,), dtype=torch.uint8, generator=gen)
    sscales = torch.rand(w, lay.nseg, generator=gen)
    got = {}
    for name, codec in codecs.items():
        ef = efs[name]
        packed, scale, b = codec.encode(x, lay, ef)
        s_true = ef.server_error(lay)
        spacked, sscale = codec.server(recv, q, lay, ef)
        out = torch.empty(n)
        codec.rebuild(signs, sscales, lay, out)
        got[name] = (packed, scale, b, spacked, sscale, ef.sc.clone(), out, s_true)
    for a, b_ in zip(got["numba"], got["torch"], strict=True):
        assert torch.equal(a, b_)  # elementwise bitwise; scales too (float64 sums)
    packed, scale, b, _, _, c, out, s_true = got["numba"]
    assert torch.equal(b, want_b)
    assert torch.allclose(scale, want_scale, rtol=1e-6, atol=0)
    bits = torch.from_numpy(np.packbits(want_sign.numpy()))
    assert torch.equal(packed, bits)
    # the server sum, rank by rank in order, plus the server error
    from overlap.compression.packbits import unpack_signs

    seg_of = torch.repeat_interleave(torch.arange(lay.nseg), torch.as_tensor(lay.seg_len))
    local = seg_of[me * lay.chunk : (me + 1) * lay.chunk]
    acc = torch.zeros(lay.chunk)
    for r in range(w):
        acc = acc + unpack_signs(recv[r]) * q[r][local]
    assert torch.equal(c, acc + s_true)
    owner = torch.arange(n) // lay.chunk
    want_out = unpack_signs(signs)[:n] * sscales[owner, seg_of[:n]]
    assert torch.equal(out, want_out)


@needs_numba
@pytest.mark.parametrize(("n", "w", "me", "segments"), CASES)
def test_two_level_sums_the_cuda_form_agree_with_the_kernels(
    n: int, w: int, me: int, segments: list[int] | None
) -> None:
    """The CUDA codec's form (float32 squares per piece, float64 per segment), run on CPU:
    elementwise stages bitwise equal to the kernels, scales within float32 rounding, and a
    segment of this rank's chunk that holds no element gets scale 0."""
    lay = Layout(n, w, me, segments)
    gen = torch.Generator().manual_seed(7 * n + w)
    x = torch.randn(n, generator=gen)
    codecs = {"numba": codec_numba.NumbaCodec(), "two": TorchCodec(two_level=True)}
    efs = {c: ErrorFeedback.zeros(lay, torch.device("cpu")) for c in codecs}
    for ef in efs.values():
        ef.wb.copy_(torch.randn(lay.P, generator=torch.Generator().manual_seed(1)) * 0.1)
        ef.ws.fill_(0.05)
        ef.sc.copy_(torch.randn(lay.chunk, generator=torch.Generator().manual_seed(2)) * 0.1)
        ef.ss.fill_(0.02)
    recv = torch.randint(0, 256, (w, lay.chunk // 8), dtype=torch.uint8, generator=gen)
    q = torch.rand(w, lay.nseg, generator=gen)
    got = {}
    for name, codec in codecs.items():
        packed, scale, b = codec.encode(x, lay, efs[name])
        spacked, sscale = codec.server(recv, q, lay, efs[name])
        got[name] = (packed, scale, b, spacked, sscale, efs[name].sc.clone())
    (p1, s1, b1, sp1, ss1, c1), (p2, s2, b2, sp2, ss2, c2) = got["numba"], got["two"]
    assert torch.equal(p1, p2) and torch.equal(b1, b2)
    assert torch.equal(sp1, sp2) and torch.equal(c1, c2)
    assert torch.allclose(s1, s2, rtol=2e-6, atol=0) and torch.allclose(ss1, ss2, rtol=2e-6, atol=0)
    assert not ss2[torch.as_tensor(lay.local_len) == 0].any()


@needs_numba
def test_rebuild_straight_into_unaligned_tensors() -> None:
    n, w = 5000, 2
    lay = Layout(n, w, 0, [3, 1997, 3000])
    gen = torch.Generator().manual_seed(3)
    signs = torch.randint(0, 256, (lay.P // 8,), dtype=torch.uint8, generator=gen)
    sscales = torch.rand(w, lay.nseg, generator=gen)
    whole = torch.empty(n)
    codec = codec_numba.NumbaCodec()
    codec.rebuild(signs, sscales, lay, whole)
    out = torch.full((n,), -7.0)
    mid, tail = torch.empty(1997), torch.empty(3000)
    codec.rebuild(signs, sscales, lay, out, [(3, mid), (2000, tail)])
    assert torch.equal(out[:3], whole[:3]) and torch.equal(out[3:], torch.full((n - 3,), -7.0))
    assert torch.equal(mid, whole[3:2000]) and torch.equal(tail, whole[2000:])


@pytest.mark.parametrize("codec_name", ["numba", "torch"])
@pytest.mark.parametrize("segments", [[5, 6147, 70000, 7], None])
def test_encode_reads_its_sources_where_they_are(
    codec_name: str, segments: list[int] | None
) -> None:
    """encode(..., sources=) over a stale buffer equals encode of the real buffer, bitwise:
    tensors that are one segment each are read in place (numba), the rest (a source that
    is not a segment: one scale for the whole buffer, or a dtype the kernel cannot read)
    are copied in first."""
    if codec_name == "numba" and not codec_numba.available():
        pytest.skip("numba not importable")
    lens = [5, 6147, 70000, 7]
    n, w = sum(lens), 2
    lay = Layout(n, w, 1, segments)
    gen = torch.Generator().manual_seed(9)
    parts = [torch.randn(k, generator=gen) for k in lens]
    x = torch.cat(parts)
    starts = [0, 5, 6152, 76152]
    sources = [(a, t) for a, t in zip(starts, parts, strict=True)]
    sources[3] = (starts[3], parts[3].double())  # another dtype: copied, not read in place
    codec = codec_numba.NumbaCodec() if codec_name == "numba" else TorchCodec()
    got = []
    for buf, src in ((x, []), (torch.full((n,), 7.0), sources)):
        ef = ErrorFeedback.zeros(lay, torch.device("cpu"))
        ef.wb.copy_(torch.randn(lay.P, generator=torch.Generator().manual_seed(1)))
        ef.ws.fill_(0.05)
        packed, scale, b = codec.encode(buf, lay, ef, src)
        got.append((packed.clone(), scale.clone(), b.clone()))
    for a, b_ in zip(*got, strict=True):
        assert torch.equal(a, b_)
    assert all(torch.equal(t, p) for (_, t), p in zip(sources[:3], parts, strict=False))


@pytest.mark.parametrize("segments", [[5, 6147, 70000, 7], None])
def test_encode_of_a_mean_equals_encode_of_the_mean_in_both_codecs(
    segments: list[int] | None,
) -> None:
    """encode(..., mean_with=y) over sources read in place (numba: in the same pass, through
    the register path and the piece loops alike; torch: into x first) equals encode of
    (x + y) * 0.5 written out beforehand, bitwise, in both codecs, and the two agree."""
    lens = [5, 6147, 70000, 7]
    n, w = sum(lens), 2
    lay = Layout(n, w, 0, segments)
    gen = torch.Generator().manual_seed(3)
    parts = [torch.randn(k, generator=gen) for k in lens]
    y = torch.randn(n, generator=gen)
    mean = (torch.cat(parts) + y) * 0.5
    starts = [0, 5, 6152, 76152]
    codecs = [TorchCodec()] + ([codec_numba.NumbaCodec()] if codec_numba.available() else [])
    got = []
    for codec in codecs:
        for fused in (False, True):
            ef = ErrorFeedback.zeros(lay, torch.device("cpu"))
            ef.wb.copy_(torch.randn(lay.P, generator=torch.Generator().manual_seed(1)))
            ef.ws.fill_(0.05)
            if fused:
                sources = list(zip(starts, parts, strict=True))
                out = codec.encode(torch.full((n,), 7.0), lay, ef, sources, mean_with=y)
            else:
                out = codec.encode(mean.clone(), lay, ef)
            got.append(tuple(t.clone() for t in out))
    for other in got[1:]:
        for a, b in zip(got[0], other, strict=True):
            assert torch.equal(a, b)


@needs_numba
@pytest.mark.parametrize(("n", "in_place"), [(4096, True), (4100, False)])
def test_a_one_tensor_bucket_is_read_in_place_when_it_needs_no_padding(
    n: int, in_place: bool
) -> None:
    """A bucket of one tensor is one segment, the whole padded buffer. When there is no
    padding (P == n) the numba encode reads the tensor where it is and never writes the
    bucket (the scheduler's last bucket, the first layer's weight, took a full copy per
    step before); with padding it copies the tensor in. Bitwise the same either way."""
    w = 2
    lay = Layout(n, w, 0, None)
    assert (n == lay.P) is in_place
    src = torch.randn(n, generator=torch.Generator().manual_seed(3))
    codec = codec_numba.NumbaCodec()
    got = []
    for buf, sources in ((src.clone(), []), (torch.full((n,), 7.0), [(0, src)])):
        ef = ErrorFeedback.zeros(lay, torch.device("cpu"))
        ef.ws.fill_(0.05)
        packed, scale, b = codec.encode(buf, lay, ef, sources)
        got.append((packed.clone(), scale.clone(), b.clone()))
        stale = buf
    for a, b_ in zip(*got, strict=True):
        assert torch.equal(a, b_)
    assert torch.equal(stale, torch.full((n,), 7.0)) is in_place


def test_lazy_error_feedback_round_trips() -> None:
    lay = Layout(100, 2, 0, [60, 40])
    ef = ErrorFeedback.zeros(lay, torch.device("cpu"))
    b = torch.randn(lay.P)
    scales = torch.tensor([0.5, 0.25, 0.0])
    ef.commit_worker(b, scales)
    seg_scale = torch.repeat_interleave(scales, torch.as_tensor(lay.seg_len))
    want = b - seg_scale * torch.where(b >= 0, 1.0, -1.0)
    assert torch.equal(ef.worker_error(lay), want)
    # zero pending scales: the stored vector is the error itself (how true errors load)
    fresh = ErrorFeedback(want.clone(), torch.zeros(lay.chunk), lay.nseg)
    assert torch.equal(fresh.worker_error(lay), want)


def test_onebit_builds_its_kernels_up_front() -> None:
    OneBit()
    assert codec_numba._tried  # compiled (or loaded from cache) at construction
    assert codec_for(torch.device("cpu")).name == ("numba" if codec_numba.available() else "torch")


@needs_numba
@pytest.mark.parametrize(("n", "w", "me", "segments"), CASES)
def test_numba_error_equals_the_torch_form_bitwise(
    n: int, w: int, me: int, segments: list[int] | None
) -> None:
    """NumbaCodec.error (one pass) against lazy_error (torch ops), worker and server side,
    into another buffer and in place, with zeros of both signs and a zero scale."""
    from overlap.compression.codec import lazy_error

    lay = Layout(n, w, me, segments)
    gen = torch.Generator().manual_seed(7 * n + w)
    numba = codec_numba.NumbaCodec()
    for side, length, lengths in (
        ("worker", lay.P, lay.seg_len),
        ("server", lay.chunk, lay.local_len),
    ):
        v = torch.randn(length, generator=gen)
        v[:3] = torch.tensor([0.0, -0.0, 1e-40])
        scales = torch.rand(lay.nseg, generator=gen)
        scales[0] = 0.0
        want = lazy_error(v, scales, lengths, torch.empty(length))
        got = numba.error(v, scales, lay, side, torch.full((length,), 9.0))
        assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit()), side
        inplace = v.clone()
        numba.error(inplace, scales, lay, side, inplace)
        assert torch.equal(inplace, want), side
