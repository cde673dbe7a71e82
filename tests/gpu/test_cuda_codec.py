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


@pytest.mark.parametrize(
    ("n", "w", "me", "segments"),
    [(38, 2, 1, [10, 3, 24, 1]), (70001, 3, 1, [65537, 7, 4457]), (1 << 22, 2, 0, None)],
)
def test_torch_codec_on_cuda_matches_the_cpu_kernels(
    n: int, w: int, me: int, segments: list[int] | None
) -> None:
    """Each codec stage on CUDA (the torch codec) against the CPU codec (numba kernels, or
    the torch codec without numba): elementwise values bitwise, scales to 1e-6 relative
    (both sum squares in float64, in different orders)."""
    from overlap.compression.codec import ErrorFeedback, codec_for
    from overlap.compression.layout import Layout

    lay = Layout(n, w, me, segments)
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen)
    recv = torch.randint(0, 256, (w, lay.chunk // 8), dtype=torch.uint8, generator=gen)
    q = torch.rand(w, lay.nseg, generator=gen)
    signs = torch.randint(0, 256, (lay.P // 8,), dtype=torch.uint8, generator=gen)
    sscales = torch.rand(w, lay.nseg, generator=gen)
    got = {}
    for dev in ("cpu", "cuda"):
        d = torch.device(dev)
        ef = ErrorFeedback.zeros(lay, d)
        ef.wb.copy_(torch.randn(lay.P, generator=torch.Generator().manual_seed(1)) * 0.1)
        ef.ws.fill_(0.05)
        ef.sc.copy_(torch.randn(lay.chunk, generator=torch.Generator().manual_seed(2)) * 0.1)
        ef.ss.fill_(0.02)
        codec = codec_for(d)
        packed, scale, b = codec.encode(x.to(d), lay, ef)
        spacked, sscale = codec.server(recv.to(d), q.to(d), lay, ef)
        out = torch.empty(n, device=d)
        codec.rebuild(signs.to(d), sscales.to(d), lay, out)
        got[dev] = [t.cpu() for t in (packed, scale, b, spacked, sscale, ef.sc, out)]
    cpu, cuda = got["cpu"], got["cuda"]
    for i in (0, 2, 3, 5, 6):  # signs, b, server signs, c, rebuilt values
        assert torch.equal(cpu[i], cuda[i]), i
    for i in (1, 4):  # worker and server scales
        assert torch.allclose(cpu[i], cuda[i], rtol=1e-6, atol=0), i
