from __future__ import annotations

from collections.abc import Callable

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


def _computing_ops(fn: Callable[[], object]) -> list[str]:
    """The ops ``fn`` dispatches that compute (each a kernel launch on CUDA), views and
    collectives left out."""
    from torch.utils._python_dispatch import TorchDispatchMode

    views = {"view", "detach", "slice", "select", "expand", "_unsafe_view", "reshape", "alias"}
    seen: list[str] = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            name = func.overloadpacket.__name__
            if name not in views:
                seen.append(name)
            return func(*args, **(kwargs or {}))

    with Seen():
        fn()
    return seen


def test_unpacking_makes_no_constants_per_call() -> None:
    """The +-1 constants are made once per device and dtype: made per call they were two
    of unpack_signs' four kernel launches on CUDA, where a 1-bit step is launch-bound."""
    packed = pack_signs(torch.randn(64))
    unpack_signs(packed)
    assert sorted(_computing_ops(lambda: unpack_signs(packed))) == [
        "__rshift__",
        "bitwise_and",
        "where",
    ]


def test_the_torch_codec_clamps_no_lengths_per_call() -> None:
    """The sums of squares' divisors are made with the layout's index, once."""
    from overlap.compression.codec import ErrorFeedback
    from overlap.compression.codec_torch import TorchCodec
    from overlap.compression.layout import layout

    lay = layout(1000, 2, 0, [400, 600])
    for two_level in (False, True):
        codec = TorchCodec(two_level=two_level)
        ef = ErrorFeedback(torch.zeros(lay.P), torch.zeros(lay.P // 2), lay.nseg)
        x = torch.randn(1000)
        codec.encode(x.clone(), lay, ef)
        ops = _computing_ops(lambda c=codec, e=ef, v=x: c.encode(v.clone(), lay, e))
        assert "clamp" not in ops and "ones" not in ops, ops
