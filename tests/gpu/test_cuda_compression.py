"""CUDA paths of the compression package; skipped where CUDA is absent."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from overlap.compression import pack_signs, unpack_signs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_pack_on_cuda_matches_numpy() -> None:
    x = torch.randn(8 * 4096, device="cuda")
    got = pack_signs(x).cpu().numpy()
    assert np.array_equal(got, np.packbits((x >= 0).cpu().numpy()))
    assert torch.equal(unpack_signs(pack_signs(x)).cpu(), torch.where(x >= 0, 1.0, -1.0).cpu())


def test_codec_same_bits_on_cpu_and_cuda() -> None:
    x = torch.randn(8 * 1000)
    assert torch.equal(pack_signs(x), pack_signs(x.cuda()).cpu())


def test_device_spans_resolve_without_a_device_wide_sync() -> None:
    from overlap.trace import Tracer

    t = Tracer()
    a = torch.randn(2048, 2048, device="cuda")
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    a @ a
    e.record()
    t.device_span("matmul", "compute", s, e)
    e.synchronize()
    assert t.resolve_device() == 0
    name, cat, t0, t1, _, args = t.spans[-1]
    assert cat == "compute"
    assert name == "matmul" and args["device"] and t1 > t0
