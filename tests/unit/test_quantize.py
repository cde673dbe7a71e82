"""The Int8/FP8 quantizers' codes and Int8's numba kernels, in one process."""

from __future__ import annotations

import pytest
import torch

from overlap import FP8, Int8
from overlap.compression.quantize import _BlockQuantized


@pytest.mark.parametrize("cls", [Int8, FP8])
def test_codes_round_trip_within_the_resolution(cls: type[Int8]) -> None:
    q = cls(block=16)
    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    x[16:32] = 0.0  # an all-zero block: scale 0, codes 0
    codes, scales = q._quantize(x)
    assert codes.dtype == torch.uint8 and codes.numel() == 64 and scales.numel() == 4
    back = q._dequantize(codes, scales)
    assert torch.equal(back[16:32], torch.zeros(16))
    rel = 0.5 / 127 if cls is Int8 else 1 / 16  # half a step; e4m3 has 3 mantissa bits
    for b in range(4):
        blk = slice(16 * b, 16 * (b + 1))
        assert (back[blk] - x[blk]).abs().max() <= rel * x[blk].abs().max() + 1e-7


def test_quantizer_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="block must be a positive int"):
        Int8(block=0)
    st = Int8(block=8).state_dict()
    with pytest.raises(ValueError, match="block=8"):
        Int8(block=16).load_state_dict(st)


def test_int8_kernels_agree_with_the_torch_stages() -> None:
    q = Int8(block=64)
    if q._k is None:
        pytest.skip("numba is not importable: Int8 runs on torch ops only")
    n = 64 * 40 + 17  # a tail block past n
    g = torch.Generator().manual_seed(1)
    x, err = torch.randn(n, generator=g), torch.randn(64 * 41, generator=g) * 0.01
    p = 64 * 42
    err = torch.cat([err, torch.zeros(p - err.numel())])
    c1, s1, e1 = q._worker(x, err, p, "k")
    c2, s2, e2 = _BlockQuantized._worker(q, x, err, p, "k")
    assert torch.equal(s1, s2)
    assert (c1 != c2).sum() <= 2  # a tie rounded the other way, at most
    assert torch.allclose(e1, e2, atol=float(s1.max()))
    assert torch.allclose(e1[c1 == c2], e2[c1 == c2], atol=1e-6)
    codes, scales = torch.cat([c1, c1]), torch.cat([s1, s1])
    for serr in (None, torch.randn(p, generator=g) * 0.01):  # the server error, if any
        a1 = q._server(codes, scales, 2, serr, "k")
        a2 = _BlockQuantized._server(q, codes, scales, 2, serr, "k")
        assert torch.equal(a1[1], a2[1]) and (a1[0] != a2[0]).sum() <= 2
        assert torch.allclose(a1[2], a2[2], atol=float(a1[1].max()))
        assert torch.allclose(a1[2][a1[0] == a2[0]], a2[2][a1[0] == a2[0]], atol=1e-6)
    out1, out2 = torch.empty(n), torch.empty(n)
    q._decode_into(c1, s1, out1)
    _BlockQuantized._decode_into(q, c1, s1, out2)
    assert torch.equal(out1, out2)
    tiny = torch.zeros(p)
    tiny[64:128] = torch.linspace(-1e-41, 1e-41, 64)  # subnormal: 127 / absmax overflows
    tiny[100] = 0.0
    c4, s4, e4 = q._worker(tiny, None, p, "t")
    d4 = torch.empty(p)
    q._decode_into(c4, s4, d4)
    assert torch.isfinite(s4).all() and torch.isfinite(e4).all()
    assert torch.equal(d4 + e4, tiny)  # what was not sent is kept, exactly
    bad = x.clone()
    bad[70] = float("inf")
    _, s3, _ = q._worker(bad, None, p, "b")
    assert torch.isnan(s3[1]) and torch.isfinite(torch.cat([s3[:1], s3[2:]])).all()


def test_a_buckets_tensors_each_start_a_block_of_their_own() -> None:
    """With the bucket's shapes, every tensor is laid out from a block boundary, padded to
    whole blocks: its values are quantized on its own scales, not on a larger neighbour's.
    Before, a 300-float bias sharing a 1024-block with a 10x larger weight came back 7-11%
    off the exact mean (2 ranks)."""
    q = Int8(block=64)
    shapes = [torch.Size([30, 7]), torch.Size([30]), torch.Size([0]), torch.Size([3, 30])]
    n = 210 + 30 + 90
    segs = q._segments("k", n, shapes)
    assert segs == ((0, 210, 0), (210, 30, 256), (240, 90, 320)), segs
    assert q._span(n, segs) == 448 and q.padded(448, 2) == 512
    assert q._segments("k", n, shapes) is segs  # kept per key
    # no layout where nothing would be padded, or the shapes do not describe the bucket
    assert q._segments("a", 128, [torch.Size([64]), torch.Size([64])]) is None
    assert q._segments("b", n, shapes[:1]) is None and q._segments("c", n + 1, shapes) is None
    assert q._segments("d", n, None) is None

    g = torch.Generator().manual_seed(3)
    small, big = torch.randn(240, generator=g) * 0.01, torch.randn(90, generator=g)
    x = torch.cat([small, big])
    p = 512
    backs = []
    stages = [(_BlockQuantized._worker, _BlockQuantized._decode_into)]  # torch ops
    if q._k is not None:
        stages.append((Int8._worker, Int8._decode_into))  # numba kernels
    for worker, decode in stages:
        codes, scales, err = worker(q, x, None, p, "k", segs)
        assert codes.numel() == p and scales.numel() == p // 64
        assert torch.equal(codes[240:256], torch.zeros(16, dtype=torch.uint8))  # padding
        out = torch.full((n,), float("nan"))
        decode(q, codes, scales, out, segs)
        backs.append(out)
        # what was sent plus what was kept is the input, each tensor at its own place
        laid = torch.cat([err[0:210], err[256:286], err[320:410]])  # the error, laid out
        assert torch.allclose(out + laid, x, atol=1e-6)
        assert not err[210:256].any() and not err[410:].any()  # the padding keeps no error
        # the small tensors' error is on their own scale (absmax / 127 / 2 at most)
        assert (out[:240] - small).abs().max() <= small.abs().max() / 254 * 1.001
    if len(backs) == 2:
        assert torch.allclose(backs[0], backs[1], atol=float(big.abs().max()) / 127)
