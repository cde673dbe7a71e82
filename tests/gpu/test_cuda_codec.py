"""The 1-bit codec on CUDA gives the CPU path's results (single process)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from overlap.compression import pack_signs, unpack_signs


@pytest.mark.parametrize("n", [8, 8 * 1000, 8 * 4096 + 8, 1 << 22])
def test_pack_on_cuda_matches_numpy_and_cpu(n: int) -> None:
    x = torch.randn(n, device="cuda")
    x[::7] = 0.0  # zero packs as +1 (sign(0) = +1), on both devices
    got = pack_signs(x).cpu()
    assert np.array_equal(got.numpy(), np.packbits((x >= 0).cpu().numpy()))
    assert torch.equal(got, pack_signs(x.cpu()))
    assert torch.equal(unpack_signs(pack_signs(x)).cpu(), torch.where(x >= 0, 1.0, -1.0).cpu())
