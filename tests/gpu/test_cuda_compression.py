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
