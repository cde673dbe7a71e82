"""Int8's numba kernels: each codec stage in one pass over memory (imported only by
:mod:`overlap.compression.quantize`, when numba is importable).

Importing this module compiles every kernel for its one signature, or loads it from numba's
on-disk cache, so no training step pays for a compile. A block of ``block`` elements is read
several times (v formed, its absmax, its codes and errors), but a block of 1024 floats is
4 KiB, so the later reads hit the cache: about one pass over memory where the torch ops
take about ten. Measured at 6.3M floats, one thread, this 2-core machine (noisy): the
worker stage (error add, scales, codes, new error) 33-36 ms against 53-86 ms on torch ops,
the server stage 35 against 50 ms (a 3.1M chunk, 2 ranks), the decode 7.6-9.4 against
11.9-30 ms. The element loop divides by the scale (a multiply by 127 / absmax overflows
for subnormal blocks, and 0 * Inf is NaN), which keeps it from being faster still.

Rounding is to nearest even (``np.rint``), as ``torch.round``. A block holding NaN or Inf
gets a NaN scale, which the server's average carries to every rank (the caller's
non-finite check).
"""

from __future__ import annotations

from typing import Any

import numba as nb
import numpy as np

_OPTS: dict[str, Any] = {"nogil": True, "cache": True, "boundscheck": False}
_F4, _I1 = "float32[::1]", "int8[::1]"


@nb.njit(f"void({_F4}, int64, {_F4}, boolean, int64, {_F4}, {_I1}, {_F4})", **_OPTS)
def encode(
    src: Any,
    n: int,
    err: Any,
    has_err: bool,
    block: int,
    err_out: Any,
    codes: Any,
    scales: Any,
) -> None:
    """codes/scales of v = src (0 past ``n``) + err, and err_out = v - code * scale.

    v is formed once into err_out (the block's own cache-resident slice), then read back."""
    nblocks = codes.size // block
    for b in range(nblocks):
        a = b * block
        e = a + block
        hi = min(max(n - a, 0), block) + a
        if has_err:
            for i in range(a, hi):
                err_out[i] = src[i] + err[i]
            for i in range(hi, e):
                err_out[i] = err[i]
        else:
            for i in range(a, hi):
                err_out[i] = src[i]
            for i in range(hi, e):
                err_out[i] = np.float32(0.0)
        m = np.float32(0.0)
        z = np.float32(0.0)  # v * 0 summed: 0 unless some v is NaN or Inf
        for i in range(a, e):
            v = err_out[i]
            z += v * np.float32(0.0)
            av = abs(v)
            m = av if av > m else m
        if z != z:
            scales[b] = np.float32(np.nan)
            for i in range(a, e):
                codes[i] = 0
                err_out[i] = np.float32(0.0)
            continue
        s = m / np.float32(127.0)
        scales[b] = s
        if s > 0:
            # v / s, not v * (127 / m): with m near the smallest floats 127 / m overflows
            # to Inf and 0 * Inf is NaN (a real pseudo-gradient hit it); v / s is at most
            # about 127 and clamped, as the torch ops do
            for i in range(a, e):
                v = err_out[i]
                q = np.rint(v / s)
                q = min(max(q, np.float32(-127.0)), np.float32(127.0))
                codes[i] = np.int8(q)
                err_out[i] = v - q * s
        else:  # all zeros, or too small for a nonzero scale: send 0, keep v as the error
            for i in range(a, e):
                codes[i] = 0


@nb.njit(f"void({_I1}, {_F4}, int64, int64, {_F4}, boolean, {_F4})", **_OPTS)
def average(codes: Any, scales: Any, w: int, block: int, err: Any, has_err: bool, out: Any) -> None:
    """out = mean over the W rows of code * scale (+ err): the server's chunk."""
    chunk = out.size
    per = chunk // block
    inv_w = np.float32(1.0) / np.float32(w)
    for b in range(per):
        a = b * block
        for i in range(a, a + block):
            out[i] = np.float32(0.0)
        for j in range(w):
            s = scales[j * per + b]
            base = j * chunk
            for i in range(a, a + block):
                out[i] += np.float32(codes[base + i]) * s
        if has_err:
            for i in range(a, a + block):
                out[i] = out[i] * inv_w + err[i]
        else:
            for i in range(a, a + block):
                out[i] = out[i] * inv_w


@nb.njit(f"void({_I1}, {_F4}, int64, int64, {_F4})", **_OPTS)
def decode(codes: Any, scales: Any, block: int, n: int, out: Any) -> None:
    """out[:n] = code * scale."""
    for b in range((n + block - 1) // block):
        a = b * block
        s = scales[b]
        for i in range(a, min(a + block, n)):
            out[i] = np.float32(codes[i]) * s
