"""DiLoCo's fused landing kernels against torch.optim.SGD and torch.isfinite (single process)."""

from __future__ import annotations

import math

import pytest
import torch

from overlap.compression import codec_numba

pytestmark = pytest.mark.skipif(not codec_numba.available(), reason="numba is not installed")


def _kernels():  # type: ignore[no-untyped-def]
    from overlap.optim import outer_kernels

    return outer_kernels


@pytest.mark.parametrize(
    ("momentum", "nesterov", "alpha"),
    [(0.3, True, 0.0), (0.9, True, 0.5), (0.9, False, 0.0), (0.0, False, 0.0), (0.0, False, 0.25)],
)
def test_sgd_land_equals_torch_sgd_then_the_merge(
    momentum: float, nesterov: bool, alpha: float
) -> None:
    k = _kernels()
    gen = torch.Generator().manual_seed(0)
    n, lr = 10_007, 0.6
    glob = torch.randn(n, generator=gen)
    local = torch.randn(n, generator=gen)
    ref_p = torch.nn.Parameter(glob.clone())
    opt = torch.optim.SGD([ref_p], lr=lr, momentum=momentum, nesterov=nesterov)
    mine_g, mine_p = glob.clone(), local.clone()
    buf = torch.empty(n)
    for step in range(3):  # the first step creates the momentum buffer, later ones use it
        avg = torch.randn(n, generator=gen)
        ref_p.grad = avg.clone()
        opt.step()
        ref_local = ref_p.detach().clone()
        if alpha:
            ref_local = ref_local * (1 - alpha) + mine_p * alpha
        k.sgd_land(
            avg.numpy(), mine_g.numpy(), mine_p.numpy(), buf.numpy(), step > 0, momentum,
            nesterov, lr, alpha,
        )  # fmt: skip
        # FMA and operation order may differ from torch's kernels: float rounding only
        torch.testing.assert_close(mine_g, ref_p.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(mine_p, ref_local, rtol=1e-6, atol=1e-6)
        if momentum:
            torch.testing.assert_close(buf, opt.state[ref_p]["momentum_buffer"])


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", [0, 4096, 10_006])
def test_all_finite_finds_every_non_finite_value(bad: float, where: int) -> None:
    k = _kernels()
    x = torch.randn(10_007)
    assert k.all_finite(x.numpy())
    x[where] = bad
    assert not k.all_finite(x.numpy())


def test_all_finite_is_true_for_the_largest_finite_values() -> None:
    """x * 0 is 0 for any finite x: no overflow can make a finite vector look non-finite."""
    k = _kernels()
    x = torch.full((4096,), torch.finfo(torch.float32).max)
    x[::2] *= -1
    assert k.all_finite(x.numpy())
    assert k.all_finite(torch.empty(0).numpy())


@pytest.mark.parametrize(("momentum", "alpha"), [(0.3, 0.0), (0.9, 0.5), (0.0, 0.0)])
@pytest.mark.parametrize("offset", [0, 5, 64])
def test_sgd_land_int8_is_decode_then_sgd_land_bitwise(
    momentum: float, alpha: float, offset: int
) -> None:
    """The landing from Int8 codes reads element i as codes[offset + i] * its block's scale,
    the float the Int8 decode writes: the same bits as decoding and then landing, for a
    parameter that starts and ends inside a block."""
    from overlap.compression import int8_kernels

    k = _kernels()
    gen = torch.Generator().manual_seed(1)
    n, block = 1000, 64
    padded = -(-(offset + n) // block) * block
    codes = torch.randint(-127, 128, (padded,), generator=gen, dtype=torch.int8)
    scales = torch.rand(padded // block, generator=gen)
    avg = torch.empty(padded)
    int8_kernels.decode(codes.numpy(), scales.numpy(), block, padded, avg.numpy())
    start = [torch.randn(n, generator=gen) for _ in range(3)]
    want, got = [t.clone() for t in start], [t.clone() for t in start]
    for step in range(2):
        hyper = (step > 0, momentum, True, 0.6, alpha)
        g, p, b = (t.numpy() for t in want)
        k.sgd_land(avg[offset : offset + n].numpy(), g, p, b if momentum else g, *hyper)
        g, p, b = (t.numpy() for t in got)
        k.sgd_land_int8(
            codes.numpy(), scales.numpy(), block, offset, g, p, b if momentum else g, *hyper
        )
        assert all(torch.equal(a, c) for a, c in zip(want, got, strict=True))


def test_pseudo_gradient_is_torch_sub_bit_for_bit() -> None:
    """The pass thread's global - local gives the very bits torch.sub does (the from-the-math
    tests hold it to float rounding only), subnormal, infinite and NaN inputs included."""
    k = _kernels()
    gen = torch.Generator().manual_seed(1)
    n = 10_007
    glob, local = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-3
    glob[:4] = torch.tensor([1e-39, math.inf, math.nan, -0.0])
    local[:4] = torch.tensor([2e-39, 1.0, 0.0, 0.0])
    out = torch.full((n,), 7.0)
    k.pseudo_gradient(glob.numpy(), local.numpy(), out.numpy())
    want = torch.sub(glob, local)
    same = (out.view(torch.int32) == want.view(torch.int32)) | (out.isnan() & want.isnan())
    assert bool(same.all())
