from __future__ import annotations

import numpy as np
import pytest
import torch

from overlap.compression import compressed_bytes, pack_signs, padded_numel, unpack_signs


@pytest.mark.parametrize("n", [8, 64, 8 * 1001])
def test_pack_matches_numpy_packbits(n: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    x[:3] = torch.tensor([0.0, -0.0, -1e-30])
    got = pack_signs(x)
    want = np.packbits((x >= 0).numpy())  # MSB first; zero (and -0.0) count as positive
    assert got.dtype == torch.uint8 and np.array_equal(got.numpy(), want)


def test_unpack_roundtrip_gives_plus_minus_one() -> None:
    x = torch.randn(800)
    s = unpack_signs(pack_signs(x))
    assert torch.equal(s, torch.where(x >= 0, 1.0, -1.0))


def test_pack_of_a_slice_with_odd_offset() -> None:
    base = torch.randn(8 * 20 + 3)
    x = base[3:]  # storage offset not a multiple of 8
    assert np.array_equal(pack_signs(x).numpy(), np.packbits((x >= 0).numpy()))


def test_pack_refuses_bad_shapes() -> None:
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_signs(torch.randn(9))


@pytest.mark.parametrize(
    ("n", "w", "p"), [(0, 2, 0), (1, 1, 8), (1, 4, 32), (33, 2, 48), (64, 8, 64), (65, 8, 128)]
)
def test_padded_numel(n: int, w: int, p: int) -> None:
    assert padded_numel(n, w) == p


def test_compressed_bytes_are_about_32x_fewer() -> None:
    n = 1 << 24
    for w in (2, 4, 8):
        fp32 = 2 * (w - 1) / w * 4 * n
        assert 31.9 < fp32 / compressed_bytes(n, w) <= 32.0
