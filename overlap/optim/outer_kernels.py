"""DiLoCo's landing in one pass: the outer Nesterov SGD step and the merge, fused (numba).

A landing with torch ops reads and writes a fragment's memory about a dozen times: a
finiteness check (``torch.isfinite(avg).all()``: a bool tensor, then a reduction), the
global weights copied into the parameters, the outer optimizer's momentum and Nesterov
updates, the result copied back into the global weights. On a 7.3M-parameter fragment, one
thread, this 2-core machine: 88 ms, against 6 ms for one copy of it. These kernels do the
same arithmetic in one pass per parameter, plus one read pass for the check (docs/diloco.md,
"Speed"). An Int8 average lands from its codes (:func:`sgd_land_int8`): no decode before it
and no check pass (the quantizer refused non-finite scales on every rank).

Only :func:`sgd_land` and :func:`sgd_land_int8` change state, and only after the caller's
finiteness check (:func:`all_finite` on a float average; the largest scale on Int8 codes)
said yes: a non-finite average leaves everything as it was.

Importing the module compiles the kernels or loads them from numba's on-disk cache, so no
training step pays for a compile (:class:`~overlap.optim.diloco.DiLoCo` imports it when it is
built).
"""

from __future__ import annotations

from typing import Any

import numba as nb
import numpy as np

_F4 = "float32[::1]"


@nb.njit(
    f"boolean({_F4})",
    nogil=True,
    cache=True,
    boundscheck=False,
    fastmath={"reassoc", "nsz"},  # the sum vectorises; NaN and Inf keep their meaning
)
def all_finite(x: Any) -> bool:
    """True when no element is NaN or +-Inf: x * 0 is 0 for finite x and NaN otherwise."""
    z = np.float32(0.0)
    for i in range(x.size):
        z += x[i] * np.float32(0.0)
    return bool(z == z)


@nb.njit(f"void({_F4}, {_F4}, {_F4})", nogil=True, cache=True, boundscheck=False)
def pseudo_gradient(glob: Any, param: Any, out: Any) -> None:
    """out = glob - param, elementwise (float32 subtraction: the same bits as
    ``torch.sub(glob, param, out=out)``). One thread and no GIL: DiLoCo runs it on its pass
    thread while the training thread computes, where a torch op would start an intra-op
    thread team of its own beside the training thread's."""
    for i in range(glob.size):
        out[i] = glob[i] - param[i]


@nb.njit(nogil=True, boundscheck=False, inline="always")  # type: ignore[untyped-decorator]
def _land_span(
    src: Any,
    scale: Any,
    glob: Any,
    param: Any,
    buf: Any,
    has_buf: bool,
    momentum: Any,
    nesterov: bool,
    lr: Any,
    alpha: Any,
) -> None:
    """The landing's arithmetic over a span whose gradient is d = src * scale (float32
    values times 1, or one block's int8 codes times its scale; each loop runs over slices
    indexed from 0, so it vectorises: see int8_kernels)."""
    keep = np.float32(1.0) - alpha
    for i in range(glob.size):
        d = np.float32(src[i]) * scale
        if momentum != 0:
            b = momentum * buf[i] + d if has_buf else d
            buf[i] = b
            s = d + momentum * b if nesterov else b
        else:
            s = d
        g = glob[i] - lr * s
        glob[i] = g
        param[i] = g if alpha == 0 else keep * g + alpha * param[i]


@nb.njit(
    f"void({_F4}, {_F4}, {_F4}, {_F4}, boolean, float32, boolean, float32, float32)",
    nogil=True,
    cache=True,
    boundscheck=False,
)
def sgd_land(
    avg: Any,
    glob: Any,
    param: Any,
    buf: Any,
    has_buf: bool,
    momentum: float,
    nesterov: bool,
    lr: float,
    alpha: float,
) -> None:
    """One parameter's landing: torch.optim.SGD's step (dampening 0, no weight decay) on the
    global weights with gradient ``avg``, then the merge into the local weights.

    b = momentum * b + d (b = d on the first step), s = d + momentum * b (Nesterov) or b,
    g = g - lr * s, local = g, or (1 - alpha) g + alpha local. ``momentum`` 0: s = d and
    ``buf`` is not touched."""
    _land_span(avg, np.float32(1.0), glob, param, buf, has_buf, momentum, nesterov, lr, alpha)


@nb.njit(
    f"void(int8[::1], {_F4}, int64, int64, {_F4}, {_F4}, {_F4}, boolean, float32, boolean, "
    "float32, float32)",
    nogil=True,
    cache=True,
    boundscheck=False,
)
def sgd_land_int8(
    codes: Any,
    scales: Any,
    block: int,
    offset: int,
    glob: Any,
    param: Any,
    buf: Any,
    has_buf: bool,
    momentum: float,
    nesterov: bool,
    lr: float,
    alpha: float,
) -> None:
    """:func:`sgd_land` with the gradient still block-quantized: element i of this parameter
    is ``codes[offset + i] * scales[(offset + i) // block]``, the very float an Int8 decode
    writes (so the same result, bitwise, as decoding and then :func:`sgd_land`), read as one
    byte where the decoded average was four, and never written out."""
    n = glob.size
    i = 0
    while i < n:
        b = (offset + i) // block
        e = min(n, (b + 1) * block - offset)
        _land_span(
            codes[offset + i : offset + e], scales[b], glob[i:e], param[i:e],
            buf[i:e] if momentum != 0 else buf, has_buf, momentum, nesterov, lr, alpha,
        )  # fmt: skip
        i = e
